"""The body of ``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``), as a
pydantic model: the shape of Cohere's and Jina's rerank APIs that vLLM
serves.

Any thread (pure CPU, no MLX); the route parses on the event loop. A
``query`` and its ``documents`` (texts, or objects with a ``text``, as
Cohere's and Jina's clients send them; at most :data:`MAX_DOCUMENTS`, none
empty), ``top_n`` (the best ones only; all by default) and
``return_documents`` (each result carries its document's text). Unknown
fields are refused by name.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ...http.protocol_common import RequestBody
from ...http.validation import parse_request
from .values import RerankParams

__all__ = ["MAX_DOCUMENTS", "RerankRequest", "parse_rerank_request"]

#: Documents one request may send (Cohere's limit).
MAX_DOCUMENTS = 1000

Text = Annotated[str, Field(min_length=1)]


class Document(BaseModel):
    """A document as an object: ``{"text": ...}``."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    text: Text


class RerankRequest(RequestBody):
    """The body of ``POST /v1/rerank``."""

    model: str
    query: Text
    documents: Annotated[
        list[Text | Document], Field(min_length=1, max_length=MAX_DOCUMENTS)
    ]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    # No effect on the output by definition: accepted, unused.
    user: str | None = None

    def texts(self) -> tuple[str, ...]:
        """Each document's text, in order."""
        return tuple(
            item if isinstance(item, str) else item.text for item in self.documents
        )

    def to_rerank_params(self) -> RerankParams:
        """The shared rerank request."""
        return RerankParams(self.query, self.texts())


def parse_rerank_request(body: bytes) -> RerankRequest:
    """Parse and validate a rerank body.

    Raises:
        APIError: 400 naming the first invalid parameter.
    """
    return parse_request(RerankRequest, body)
