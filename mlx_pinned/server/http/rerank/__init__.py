"""The rerank slice of the HTTP side: ``POST /v1/rerank`` (with vLLM's
``/rerank`` and ``/v2/rerank``), in the shape of Cohere's and Jina's
rerank APIs.

Event loop only, as all of :mod:`..http`. The protocol (:mod:`.protocol`,
which turns into the shared :class:`~...encoders.RerankParams`), the
ranking of the scores (:mod:`.serving`) and the route (:mod:`.route`); the
model runs where its engine keeps it, on the MLX thread
(:class:`~...encoders.RerankEngine`).
"""

from .route import RERANK_PATHS as RERANK_PATHS
from .route import RerankEndpoint as RerankEndpoint

__all__ = ["RERANK_PATHS", "RerankEndpoint"]
