"""The rerank kind: ``/v1/rerank`` (and vLLM's ``/rerank``, ``/v2/rerank``).
Any thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import Kind
from .values import RerankEngine

if TYPE_CHECKING:
    from pathlib import Path

    from mlx_pinned import MLXThread

    from ...config import ModelSettings


def _load(settings: ModelSettings, thread: MLXThread) -> Any:
    from .engine import RerankEngine

    return RerankEngine.load(settings, thread)


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from .route import RerankEndpoint

    return routes(RerankEndpoint(wiring))


def _demo() -> Path:
    from mlx_pinned.testing import tiny_reranker_path

    return tiny_reranker_path()


KIND = Kind(
    name="rerank",
    what="a rerank model",
    paths=("/v1/rerank", "/rerank", "/v2/rerank"),
    protocol=RerankEngine,
    settings=frozenset({"prefill_step_seconds"}),  # its passes are paced
    load=_load,
    routes=_routes,
    demo=_demo,
)
