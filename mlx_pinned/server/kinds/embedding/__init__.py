"""The embedding kind: ``/v1/embeddings``. Any thread."""

from __future__ import annotations

from typing import Any

from .. import Kind
from .values import EmbeddingEngine


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from .route import EmbeddingsEndpoint

    return routes(EmbeddingsEndpoint(wiring))


KIND = Kind(
    name="embedding",
    what="an embedding model",
    paths=("/v1/embeddings",),
    protocol=EmbeddingEngine,
    routes=_routes,
)
