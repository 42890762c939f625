"""Rerank's scores made results: ranked, best first, cut to ``top_n``. Event
loop. Nothing is checked against the model before it scores: a document too
long for it is cut at its end (as Cohere's API and mlx-vlm's server do)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol import RerankRequest
    from .values import Scores

__all__ = ["ranked"]


def ranked(request: RerankRequest, scores: Scores) -> list[dict[str, Any]]:
    """Each document's index and score (and text, with ``return_documents``),
    the most relevant first (ties in document order), at most ``top_n``."""
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
