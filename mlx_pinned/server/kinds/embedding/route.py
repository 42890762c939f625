"""``POST /v1/embeddings``, in OpenAI's shape: the embedding kind's door.
Event loop; a large answer is written in a worker thread."""

from __future__ import annotations

import base64
import functools
import json
import sys
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio

from ...failures import PromptTooLongError
from ...http.door import Call, Door
from ...http.errors import APIError
from . import KIND
from .protocol import EmbeddingRequest, parse_embedding_request
from .serving import EmbeddingsServing
from .values import EmbeddingEngine, EmbeddingParams, Embeddings

if TYPE_CHECKING:
    from ...http.wire import RequestLog
    from ...media import ImageRef

__all__ = ["INLINE_VALUES", "EmbeddingsEndpoint", "embeddings_body"]

#: Values an answer may hold and still be written on the event loop.
INLINE_VALUES = 16384


@dataclass(frozen=True, slots=True)
class Embedding:
    """A request checked against its model: its inputs, its images (refs,
    then decoded)."""

    params: EmbeddingParams
    images: list[ImageRef]
    decoded: tuple[Any, ...] = field(default=())


_Call: TypeAlias = Call[EmbeddingRequest, EmbeddingEngine, Embedding]


class EmbeddingsEndpoint(
    Door[EmbeddingRequest, EmbeddingEngine, Embedding, Embeddings]
):
    route = "POST /v1/embeddings"
    api = "embeddings"
    kind = KIND.name
    prompt = "input"
    serving = EmbeddingsServing()

    async def parse(self, body: bytes, places: list[str]) -> EmbeddingRequest:
        request = parse_embedding_request(body)
        places.extend(param for param, _ in request.image_parts())
        return request

    async def prepare(
        self, request: EmbeddingRequest, engine: EmbeddingEngine
    ) -> Embedding:
        params, refs = self.serving.prepare(
            request, engine.facts, self.config.image_limits
        )
        return Embedding(params, refs)

    async def media(
        self, prepared: Embedding, engine: EmbeddingEngine, log: RequestLog
    ) -> Embedding:
        decoded = await self.decode_images(prepared.images, log)
        return replace(prepared, decoded=decoded)

    @asynccontextmanager
    async def run(self, call: _Call) -> AsyncIterator[Embeddings]:
        params = call.prepared.params
        try:
            embedded = await call.engine.embed(params, call.prepared.decoded)
        except PromptTooLongError as exc:
            if not params.messages:
                raise
            # The conversation, not an input, is too long.
            raise APIError(400, exc.message, param="messages", code=exc.code) from None
        yield embedded

    async def send_whole(self, call: _Call, output: Embeddings) -> None:
        call.log.prompt_tokens = output.prompt_tokens
        encoding = call.request.encoding_format
        write = functools.partial(embeddings_body, output, call.served.name, encoding)
        # Off the loop past a few vectors: every stream waits on the loop.
        values = sum(len(raw) for raw in output.vectors) // 4
        if values > INLINE_VALUES:
            answer = await anyio.to_thread.run_sync(write)
        else:
            answer = write()
        await call.response.json(answer)


def embeddings_body(embedded: Embeddings, model: str, encoding: str) -> bytes:
    """The answer's JSON: each vector as floats, or as base64 of its
    little-endian float32 bytes."""
    data = [
        {"object": "embedding", "index": index, "embedding": _encoded(raw, encoding)}
        for index, raw in enumerate(embedded.vectors)
    ]
    tokens = embedded.prompt_tokens
    answer = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json.dumps(answer, separators=(",", ":")).encode()


def _encoded(raw: bytes, encoding: str) -> str | list[float]:
    if encoding == "base64":
        return base64.b64encode(raw).decode("ascii")
    values = array("f", raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
