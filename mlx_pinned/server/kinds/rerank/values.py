"""What the event loop and the MLX thread hand each other for the rerank
kind: the request (:class:`RerankParams`), its scores (:class:`Scores`) and
the engine's protocol. Any thread (no MLX, no Starlette)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ...resident import Resident

__all__ = ["RerankEngine", "RerankFacts", "RerankParams", "Scores"]


@dataclass(frozen=True)
class RerankParams:
    """What one rerank request needs: a query and the documents to score
    against it.

    Attributes:
        query: The query (tokenized with the model's tokenizer).
        documents: Each document, in order; each is scored as the pair
            (query, document), cut at the end where the pair is longer than
            the model's positions.
    """

    query: str
    documents: tuple[str, ...]


@dataclass(frozen=True)
class Scores:
    """One rerank request's scores.

    Attributes:
        scores: Each document's relevance to the query, in document order,
            from 0 to 1 (the sigmoid of the model's logit).
        prompt_tokens: Tokens of all the pairs (padding excluded).
    """

    scores: tuple[float, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RerankFacts:
    """What a loaded rerank model is, built by its engine at load.

    Attributes:
        max_input_tokens: Tokens of the longest pair it scores (special
            tokens included); a longer pair is cut at its document's end.
    """

    max_input_tokens: int

    def card(self) -> dict[str, Any]:
        return {"max_input_tokens": self.max_input_tokens}


@runtime_checkable
class RerankEngine(Resident, Protocol):
    """A loaded rerank model (a cross-encoder) as the HTTP side sees it."""

    @property
    def facts(self) -> RerankFacts:
        """What the model is."""
        ...

    async def score(self, params: RerankParams) -> Scores:
        """Score each document of ``params`` against its query.

        Event loop; the tokenizer and the model run on the MLX thread, the
        pairs of every request waiting then padded into shared forward
        passes. Cancelling it drops the pairs not yet scored.

        Raises:
            PromptTooLongError: The query alone leaves no room for a
                document.
        """
        ...
