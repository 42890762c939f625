"""The embedding kind: ``/v1/embeddings`` (and Ollama's ``/api/embed``).
Any thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import Kind
from .values import EmbeddingEngine

if TYPE_CHECKING:
    from pathlib import Path

    from mlx_pinned import MLXThread

    from ...config import ModelSettings


def _load(settings: ModelSettings, thread: MLXThread) -> Any:
    from .engine import EmbeddingEngine

    return EmbeddingEngine.load(settings, thread)


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from ...http.ollama import EmbeddingsEndpoint as Legacy
    from ...http.ollama import EmbedEndpoint
    from .route import EmbeddingsEndpoint

    return routes(EmbeddingsEndpoint(wiring), EmbedEndpoint(wiring), Legacy(wiring))


def _demo() -> Path:
    from mlx_pinned.testing import tiny_embedding_path

    return tiny_embedding_path()


KIND = Kind(
    name="embedding",
    what="an embedding model",
    paths=("/v1/embeddings",),
    protocol=EmbeddingEngine,
    settings=frozenset({"prefill_step_seconds"}),  # its passes are paced
    load=_load,
    routes=_routes,
    demo=_demo,
)
