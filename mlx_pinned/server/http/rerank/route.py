"""``POST /v1/rerank`` (and vLLM's ``/rerank`` and ``/v2/rerank``), in the
shape of Cohere's and Jina's rerank APIs that vLLM serves.

Event loop. A :class:`~..endpoint.ModelEndpoint` of the rerank kind: the
base reads the body, keeps the deadline, watches the client, holds the
model named by ``model`` (404 for one not served, 400 for another kind)
and answers every error in OpenAI's shape, as the other routes do. The
request takes a turn of its model's gate, then the engine scores each
(query, document) pair on the MLX thread, in passes it shares with the
other requests waiting then.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar, cast

from ..endpoint import ModelEndpoint
from ..errors import APIError, api_error
from ..wire import random_hex
from .protocol import parse_rerank_request
from .serving import ranked

if TYPE_CHECKING:
    from ...config import ModelKind
    from ...encoders import RerankEngine
    from ..served_models import ServedModel
    from ..wire import RequestLog, ResponseWriter

__all__ = ["RERANK_PATHS", "RerankEndpoint"]

#: The paths of the one rerank door (vLLM's three).
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


class RerankEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /v1/rerank``: ``{"id", "model",
    "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index",
    "relevance_score", "document"?}]}``."""

    route = "POST /v1/rerank"
    kind: ClassVar[ModelKind] = "rerank"

    @asynccontextmanager
    async def reranker(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, RerankEngine]]:
        """:meth:`resident` of a rerank model (its kind's engine)."""
        async with self.resident(name, log) as (served, engine):
            yield served, cast("RerankEngine", engine)

    def error_for(self, exc: BaseException, images: Sequence[str]) -> APIError | None:
        return api_error(exc, retry_after=self.config.retry_after, prompt="query")

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_rerank_request(body)
        async with self.reranker(request.model, log) as (served, engine):
            async with served.gate.turn():
                scores = await engine.score(request.to_rerank_params())
            log.prompt_tokens = tokens = scores.prompt_tokens
            answer = {
                "id": f"rerank-{random_hex(128)}",
                "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": ranked(request, scores),
            }
            await response.json(json.dumps(answer, ensure_ascii=False).encode())
