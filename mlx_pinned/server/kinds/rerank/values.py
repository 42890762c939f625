"""What the event loop and the MLX thread hand each other for the rerank
kind, and its engine's protocol. Any thread (no MLX, no Starlette)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ...resident import Resident

__all__ = ["RerankEngine", "RerankFacts", "RerankParams", "Scores"]


@dataclass(frozen=True)
class RerankParams:
    """A query and the documents to score against it, each as the pair
    (query, document), cut at the document's end to fit the model."""

    query: str
    documents: tuple[str, ...]


@dataclass(frozen=True)
class Scores:
    """Each document's relevance (0 to 1: the sigmoid of the model's logit),
    in document order, and the pairs' tokens (no padding)."""

    scores: tuple[float, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RerankFacts:
    """What a loaded rerank model is, built by its engine at load.

    Attributes:
        max_input_tokens: Tokens of its longest pair, special tokens
            included; a longer pair is cut at its document's end.
    """

    max_input_tokens: int

    def card(self) -> dict[str, Any]:
        return {"max_input_tokens": self.max_input_tokens}


@runtime_checkable
class RerankEngine(Resident, Protocol):
    """A loaded rerank model (a cross-encoder) as the HTTP side sees it."""

    @property
    def facts(self) -> RerankFacts: ...

    async def score(self, params: RerankParams) -> Scores:
        """Score each document of ``params`` against its query. Event loop;
        cancelling it drops the pairs not yet scored.

        Raises:
            PromptTooLongError: The query leaves no room for a document.
        """
        ...
