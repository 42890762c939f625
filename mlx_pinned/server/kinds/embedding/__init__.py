"""The embedding kind: ``/v1/embeddings``. Any thread."""

from __future__ import annotations

from .. import Kind
from .values import EmbeddingEngine

KIND = Kind(
    name="embedding",
    what="an embedding model",
    paths=("/v1/embeddings",),
    protocol=EmbeddingEngine,
)
