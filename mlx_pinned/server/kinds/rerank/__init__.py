"""The rerank kind: ``/v1/rerank`` (and vLLM's ``/rerank``, ``/v2/rerank``).
Any thread."""

from __future__ import annotations

from typing import Any

from .. import Kind
from .values import RerankEngine


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from .route import RerankEndpoint

    return routes(RerankEndpoint(wiring))


KIND = Kind(
    name="rerank",
    what="a rerank model",
    paths=("/v1/rerank", "/rerank", "/v2/rerank"),
    protocol=RerankEngine,
    routes=_routes,
)
