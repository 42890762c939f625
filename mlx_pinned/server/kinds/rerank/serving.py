"""Rerank's one place a request's scores become its results: ranked, best
first, cut to ``top_n``.

Event loop. Nothing of the request needs the model before it is scored:
the query's length is checked by the engine, which tokenizes it on the MLX
thread, and a document longer than the model's positions is cut at its end
(as Cohere's API and mlx-vlm's server do), not refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol import RerankRequest
    from .values import Scores

__all__ = ["ranked"]


def ranked(request: RerankRequest, scores: Scores) -> list[dict[str, Any]]:
    """The results: each document's index and score (and its text, with
    ``return_documents``), the most relevant first (ties in document
    order), at most ``top_n`` of them."""
    order = sorted(range(len(scores.scores)), key=lambda i: -scores.scores[i])
    texts = request.texts()
    results: list[dict[str, Any]] = []
    for index in order[: request.top_n]:
        result: dict[str, Any] = {
            "index": index,
            "relevance_score": scores.scores[index],
        }
        if request.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return results
