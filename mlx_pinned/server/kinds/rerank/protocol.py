"""The body of ``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``), as a
pydantic model: Cohere's and Jina's rerank API as vLLM serves it, no
document empty. Any thread."""

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
        return tuple(
            item if isinstance(item, str) else item.text for item in self.documents
        )

    def to_rerank_params(self) -> RerankParams:
        return RerankParams(self.query, self.texts())


def parse_rerank_request(body: bytes) -> RerankRequest:
    """Parse and validate a rerank body; a 400 :class:`APIError` names the
    first invalid parameter."""
    return parse_request(RerankRequest, body)
