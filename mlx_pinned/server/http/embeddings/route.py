"""``POST /v1/embeddings``, in OpenAI's shape.

Event loop. A :class:`~..endpoint.ModelEndpoint` of the embedding kind: the
base reads the body, keeps the deadline, watches the client, holds the
model named by ``model`` (404 for one not served, 400 for a chat model) and
answers every error in OpenAI's shape, as the generation routes do. The
request takes a turn of its model's gate (so its waiting room is bounded as
a chat model's is), then the engine embeds its inputs on the MLX thread, in
passes it shares with the other requests waiting then; a large answer is
written in a worker thread, so the streams on the loop never wait on it.
"""

from __future__ import annotations

import base64
import functools
import json
import sys
from array import array
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar, cast

import anyio

from ...failures import PromptTooLongError, RequestError
from ..endpoint import ModelEndpoint
from ..errors import APIError, api_error
from .protocol import parse_embedding_request
from .serving import EmbeddingsServing

if TYPE_CHECKING:
    from ...config import ModelKind
    from ...encoders import EmbeddingEngine, Embeddings
    from ..served_models import ServedModel
    from ..wire import RequestLog, ResponseWriter

__all__ = ["INLINE_VALUES", "EmbeddingsEndpoint", "embeddings_body"]

#: Values an answer may hold and still be written on the event loop; a
#: larger one is written in a worker thread.
INLINE_VALUES = 16384


class EmbeddingsEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /v1/embeddings``: ``{"object": "list",
    "data": [{"object": "embedding", "index", "embedding"}], "model",
    "usage": {"prompt_tokens", "total_tokens"}}``."""

    route = "POST /v1/embeddings"
    kind: ClassVar[ModelKind] = "embedding"
    serving = EmbeddingsServing()

    @asynccontextmanager
    async def embedder(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, EmbeddingEngine]]:
        """:meth:`resident` of an embedding model (its kind's engine)."""
        async with self.resident(name, log) as (served, engine):
            yield served, cast("EmbeddingEngine", engine)

    def error_for(self, exc: BaseException, images: Sequence[str]) -> APIError | None:
        if type(exc) is RequestError:  # the engine's refusal of an input
            return APIError(400, exc.message, param="input", code=exc.code)
        return api_error(
            exc, retry_after=self.config.retry_after, images=images, prompt="input"
        )

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_embedding_request(body)
        images.extend(param for param, _ in request.image_parts())
        async with self.embedder(request.model, log) as (served, engine):
            limits = self.config.image_limits
            params, refs = self.serving.prepare(request, engine, limits)
            decoded = await self.decode_images(refs, log)
            async with served.gate.turn():
                try:
                    embedded = await engine.embed(params, decoded)
                except PromptTooLongError as exc:
                    if not params.messages:
                        raise
                    # The conversation, not an input, is too long.
                    raise APIError(
                        400, exc.message, param="messages", code=exc.code
                    ) from None
            log.prompt_tokens = embedded.prompt_tokens
            write = functools.partial(
                embeddings_body, embedded, served.name, request.encoding_format
            )
            # Written off the loop past a few vectors: a 2048 x 1024 answer's
            # floats take a second to write, and every stream waits on the loop.
            values = sum(len(raw) for raw in embedded.vectors) // 4
            if values > INLINE_VALUES:
                answer = await anyio.to_thread.run_sync(write)
            else:
                answer = write()
            await response.json(answer)


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
