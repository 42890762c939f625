"""``POST /v1/rerank`` (and vLLM's ``/rerank`` and ``/v2/rerank``), in the
shape of Cohere's and Jina's rerank APIs that vLLM serves: the rerank kind's
door. Event loop."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeAlias

from ...http.door import Call, Door
from ...http.wire import random_hex
from . import KIND
from .protocol import RerankRequest, parse_rerank_request
from .serving import ranked
from .values import RerankEngine, RerankParams, Scores

__all__ = ["RerankEndpoint"]

_Call: TypeAlias = Call[RerankRequest, RerankEngine, RerankParams]


class RerankEndpoint(Door[RerankRequest, RerankEngine, RerankParams, Scores]):
    route = "POST /v1/rerank"
    api = "rerank"
    paths = KIND.paths  # vLLM's three
    kind = KIND.name
    prompt = "query"

    async def parse(self, body: bytes, places: list[str]) -> RerankRequest:
        return parse_rerank_request(body)

    async def prepare(
        self, request: RerankRequest, engine: RerankEngine
    ) -> RerankParams:
        return request.to_rerank_params()

    @asynccontextmanager
    async def run(self, call: _Call) -> AsyncIterator[Scores]:
        yield await call.engine.score(call.prepared)

    async def send_whole(self, call: _Call, output: Scores) -> None:
        call.log.prompt_tokens = tokens = output.prompt_tokens
        answer = {
            "id": f"rerank-{random_hex(128)}",
            "model": call.served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": ranked(call.request, output),
        }
        await call.response.json(json.dumps(answer, ensure_ascii=False).encode())
