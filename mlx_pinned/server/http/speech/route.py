"""``POST /v1/audio/speech``, in OpenAI's shape.

Event loop. A :class:`~..endpoint.ModelEndpoint` of the speech kind: the
base reads the body, keeps the deadline, watches the client, holds the
model named by ``model`` (404 for one not served, 400 for another kind)
and answers every error in OpenAI's shape, as the other routes do. The
request takes a turn of its model's gate, then the engine speaks on the
MLX thread, a piece at a time. The answer is the whole file when
``stream_format`` is left out; with ``audio`` the bytes go out as they are
made, with ``sse`` as OpenAI's events (``speech.audio.delta``, each the
base64 of what the ``audio`` stream would send then, and
``speech.audio.done`` with the usage). The status goes with the first
piece, so a generation that fails before any audio is still an error
status; one that fails later ends the stream early (``audio``) or with an
error event (``sse``). A client that goes away stops the generation on the
MLX thread before its next piece.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, ClassVar, cast

import anyio

from ..endpoint import ModelEndpoint
from ..errors import OpenAIErrors
from ..wire import sse_event
from .formats import MEDIA_TYPES, StreamEncoder, encoded
from .protocol import parse_speech_request
from .serving import SpeechServing

if TYPE_CHECKING:
    from ...config import ModelKind
    from ...speech import SpeechChunk, SpeechEngine
    from ..errors import APIError
    from ..served_models import ServedModel
    from ..wire import RequestLog, ResponseWriter
    from .protocol import SpeechRequest

__all__ = ["SpeechEndpoint"]


class _AudioStreamErrors(OpenAIErrors):
    """OpenAI's errors, but a failure in an audio stream already begun ends
    it where it is: an error event would be heard as audio."""

    def event(self, error: APIError) -> bytes:
        return b""


_AUDIO_STREAM_ERRORS = _AudioStreamErrors()


class SpeechEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /v1/audio/speech``: the audio, whole or
    streamed, as its ``response_format`` (``mp3``, ``opus``, ``flac``,
    ``wav`` or ``pcm``; ``mp3`` and ``flac`` whole only)."""

    route = "POST /v1/audio/speech"
    kind: ClassVar[ModelKind] = "speech"
    serving = SpeechServing()

    @asynccontextmanager
    async def speaker(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, SpeechEngine]]:
        """:meth:`resident` of a speech model (its kind's engine)."""
        async with self.resident(name, log) as (served, engine):
            yield served, cast("SpeechEngine", engine)

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_speech_request(body)
        log.stream = request.stream_format is not None
        self.serving.check_format(request)
        async with self.speaker(request.model, log) as (served, engine):
            params = self.serving.prepare(request, engine)
            async with served.gate.turn():
                async with aclosing(engine.speak(params)) as chunks:
                    if request.stream_format is None:
                        await self._whole(request, engine, chunks, response, log)
                    elif request.stream_format == "audio":
                        await self._audio(request, engine, chunks, response, log)
                    else:
                        await self._sse(request, engine, chunks, response, log)

    async def _whole(
        self,
        request: SpeechRequest,
        engine: SpeechEngine,
        chunks: AsyncIterator[SpeechChunk],
        response: ResponseWriter,
        log: RequestLog,
    ) -> None:
        """The whole file, once the generation ended."""
        pcm = b"".join([_counted(chunk, log).pcm async for chunk in chunks])
        fmt, rate = request.response_format, engine.sample_rate
        if fmt in ("wav", "pcm"):  # a header at most
            answer = encoded(fmt, pcm, rate)
        else:  # an encoder's work: off the loop, which every stream waits on
            answer = await anyio.to_thread.run_sync(encoded, fmt, pcm, rate)
        await response.whole(answer, [(b"content-type", MEDIA_TYPES[fmt])])

    async def _audio(
        self,
        request: SpeechRequest,
        engine: SpeechEngine,
        chunks: AsyncIterator[SpeechChunk],
        response: ResponseWriter,
        log: RequestLog,
    ) -> None:
        """The bytes as they are made (a streamed header first, for
        ``wav``), the status with the first of them."""
        media = MEDIA_TYPES[request.response_format]
        response.errors = _AUDIO_STREAM_ERRORS
        async with aclosing(_encoded(request, engine, chunks, log)) as pieces:
            async for data in pieces:
                if not response.started:
                    await response.start_file_stream(media, data)
                else:
                    await response.send(data)
        if not response.started:  # no audio at all
            await response.start_file_stream(media, b"")
        await response.send(b"", more=False)

    async def _sse(
        self,
        request: SpeechRequest,
        engine: SpeechEngine,
        chunks: AsyncIterator[SpeechChunk],
        response: ResponseWriter,
        log: RequestLog,
    ) -> None:
        """OpenAI's events: a delta of what the ``audio`` stream would send
        then, a piece at a time, then the usage."""
        async with aclosing(_encoded(request, engine, chunks, log)) as pieces:
            async for data in pieces:
                if not response.started:
                    await response.start_stream(_delta(data))
                else:
                    await response.send(_delta(data))
        if not response.started:
            await response.start_stream(b"")
        usage = {
            "input_tokens": log.prompt_tokens,
            "output_tokens": log.completion_tokens,
            "total_tokens": log.prompt_tokens + log.completion_tokens,
        }
        done = {"type": "speech.audio.done", "usage": usage}
        await response.send(sse_event(done), more=False)


async def _encoded(
    request: SpeechRequest,
    engine: SpeechEngine,
    chunks: AsyncIterator[SpeechChunk],
    log: RequestLog,
) -> AsyncGenerator[bytes, None]:
    """The streamed answer's bytes as the pieces come, none empty: Opus is
    encoded in a worker thread, off the loop every stream waits on."""
    encoder = StreamEncoder(request.response_format, engine.sample_rate)
    run = anyio.to_thread.run_sync if encoder.slow else _inline
    try:
        async for chunk in chunks:
            data = await run(encoder.feed, _counted(chunk, log).pcm)
            if data:
                yield data
        if data := await run(encoder.end):
            yield data
    finally:
        encoder.close()


async def _inline(fn: Callable[..., bytes], *args: object) -> bytes:
    return fn(*args)


def _counted(chunk: SpeechChunk, log: RequestLog) -> SpeechChunk:
    """``chunk``, counted in ``log`` as it comes (text tokens as the
    prompt's, audio frames as the completion's, the first piece's time as
    the first token's)."""
    log.last_token = time.perf_counter()
    log.first_token = log.first_token or log.last_token
    log.prompt_tokens = chunk.input_tokens
    log.completion_tokens += chunk.frames
    return chunk


def _delta(audio: bytes) -> bytes:
    encoded = base64.b64encode(audio).decode("ascii")
    return sse_event({"type": "speech.audio.delta", "audio": encoded})
