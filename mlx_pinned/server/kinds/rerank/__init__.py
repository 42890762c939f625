"""The rerank kind: ``/v1/rerank`` (and vLLM's ``/rerank``, ``/v2/rerank``).
Any thread."""

from __future__ import annotations

from .. import Kind
from .values import RerankEngine

KIND = Kind(
    name="rerank",
    what="a rerank model",
    paths=("/v1/rerank", "/rerank", "/v2/rerank"),
    protocol=RerankEngine,
)
