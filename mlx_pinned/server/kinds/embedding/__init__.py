"""The embedding kind: ``/v1/embeddings``. Any thread."""

from __future__ import annotations

from ...encoders import EmbeddingEngine
from .. import Kind

KIND = Kind(
    name="embedding",
    what="an embedding model",
    paths=("/v1/embeddings",),
    protocol=EmbeddingEngine,
)
