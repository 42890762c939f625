"""The embedding kind's Ollama doors, ``POST /api/embed`` and the older
``POST /api/embeddings``, in Ollama's shape (errors too). Event loop.

The vectors and the ``dimensions`` check are ``/v1/embeddings``'s. A request
with no input loads (or, with ``keep_alive`` 0, unloads) the model."""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ...failures import PromptTooLongError
from ...kinds.embedding.values import EmbeddingEngine, EmbeddingParams, Embeddings
from ..door import Call
from ..errors import APIError
from ..validation import parse_request
from .output import embed_metrics
from .protocol import EmbeddingsRequest, EmbedRequest
from .route import OllamaDoor, load_seconds

__all__ = ["EmbedEndpoint", "EmbeddingsEndpoint"]


def _floats(raw: bytes) -> list[float]:
    values = array("f", raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


class EmbedEndpoint(OllamaDoor[EmbedRequest]):
    """``{"model", "embeddings": [[...]], "total_duration",
    "load_duration", "prompt_eval_count"}``."""

    route = "POST /api/embed"
    api = "ollama_embed"
    kind = "embedding"
    prompt = "input"

    async def parse(self, body: bytes, places: list[str]) -> EmbedRequest:
        return parse_request(EmbedRequest, body)

    def done(self, request: EmbedRequest, reason: str) -> dict[str, Any]:
        return {"embeddings": []}

    async def prepare(
        self, request: EmbedRequest, engine: EmbeddingEngine
    ) -> EmbeddingParams:
        dimensions = request.dimensions
        why = None if dimensions is None else engine.facts.refuses_width(dimensions)
        if why is not None:
            message = f"Invalid value for 'dimensions': {dimensions}; {why}."
            raise APIError(400, message, param="dimensions")
        return EmbeddingParams(tuple(request.texts), request.dimensions)

    @asynccontextmanager
    async def run(
        self, call: Call[EmbedRequest, EmbeddingEngine, EmbeddingParams]
    ) -> AsyncIterator[Embeddings]:
        self.kept(call.served, call.request)
        try:
            yield await call.engine.embed(call.prepared)
        except PromptTooLongError as exc:
            if call.request.truncate:
                # The engine refuses a long input; it cuts none.
                message = (
                    f"{exc.message} This server does not truncate inputs "
                    "('truncate' is not honoured): shorten it."
                )
                raise APIError(400, message, param="truncate") from None
            raise

    async def send_whole(
        self,
        call: Call[EmbedRequest, EmbeddingEngine, EmbeddingParams],
        output: Embeddings,
    ) -> None:
        call.log.prompt_tokens = output.prompt_tokens
        answer = {
            "model": call.request.model,
            "embeddings": [_floats(raw) for raw in output.vectors],
            **embed_metrics(output.prompt_tokens, call.log.start, load_seconds()),
        }
        await call.response.json(json.dumps(answer, separators=(",", ":")).encode())


class EmbeddingsEndpoint(OllamaDoor[EmbeddingsRequest]):
    """The older ``{"embedding": [...]}`` of one ``prompt``."""

    route = "POST /api/embeddings"
    api = "ollama_embeddings"
    kind = "embedding"
    prompt = "prompt"

    async def parse(self, body: bytes, places: list[str]) -> EmbeddingsRequest:
        return parse_request(EmbeddingsRequest, body)

    def done(self, request: EmbeddingsRequest, reason: str) -> dict[str, Any]:
        return {"embedding": []}

    async def prepare(
        self, request: EmbeddingsRequest, engine: EmbeddingEngine
    ) -> EmbeddingParams:
        return EmbeddingParams((request.prompt,))

    @asynccontextmanager
    async def run(
        self, call: Call[EmbeddingsRequest, EmbeddingEngine, EmbeddingParams]
    ) -> AsyncIterator[Embeddings]:
        self.kept(call.served, call.request)
        yield await call.engine.embed(call.prepared)

    async def send_whole(
        self,
        call: Call[EmbeddingsRequest, EmbeddingEngine, EmbeddingParams],
        output: Embeddings,
    ) -> None:
        call.log.prompt_tokens = output.prompt_tokens
        answer = {"embedding": _floats(output.vectors[0])}
        await call.response.json(json.dumps(answer, separators=(",", ":")).encode())
