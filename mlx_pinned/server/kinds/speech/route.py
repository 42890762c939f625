"""``POST /v1/audio/speech``, in OpenAI's shape: the speech kind's door.

Event loop. A stream's status goes with its first piece; a failure after it
ends an ``audio`` stream where it is (an error event would be heard as
audio) and an ``sse`` stream with an error event.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, TypeAlias

import anyio

from ...http.door import Call, Door
from ...http.wire import sse_event
from . import KIND
from .encoding import MEDIA_TYPES, StreamEncoder, encoded
from .protocol import SpeechRequest, parse_speech_request
from .serving import SpeechServing
from .values import SpeechChunk, SpeechEngine, SpeechParams

if TYPE_CHECKING:
    from ...http.wire import RequestLog

__all__ = ["SpeechEndpoint"]

_Chunks: TypeAlias = AsyncIterator[SpeechChunk]
_Call: TypeAlias = Call[SpeechRequest, SpeechEngine, SpeechParams]


class SpeechEndpoint(Door[SpeechRequest, SpeechEngine, SpeechParams, _Chunks]):
    route = "POST /v1/audio/speech"
    api = KIND.name
    kind = KIND.name
    prompt = "input"
    serving = SpeechServing()

    async def parse(self, body: bytes, places: list[str]) -> SpeechRequest:
        request = parse_speech_request(body)
        self.serving.check_format(request)  # whatever the model
        return request

    def streamed(self, request: SpeechRequest) -> bool:
        return request.stream_format is not None

    async def prepare(
        self, request: SpeechRequest, engine: SpeechEngine
    ) -> SpeechParams:
        return self.serving.prepare(request, engine.facts)

    @asynccontextmanager
    async def run(self, call: _Call) -> AsyncIterator[_Chunks]:
        async with aclosing(call.engine.speak(call.prepared)) as chunks:
            yield chunks

    async def send_whole(self, call: _Call, output: _Chunks) -> None:
        pcm = b"".join([_counted(chunk, call.log).pcm async for chunk in output])
        fmt, rate = call.request.response_format, call.engine.facts.sample_rate
        if fmt in ("wav", "pcm"):  # a header at most
            answer = encoded(fmt, pcm, rate)
        else:  # an encoder's work: off the loop, which every stream waits on
            answer = await anyio.to_thread.run_sync(encoded, fmt, pcm, rate)
        await call.response.whole(answer, [(b"content-type", MEDIA_TYPES[fmt])])

    async def send_stream(self, call: _Call, output: _Chunks) -> None:
        if call.request.stream_format == "audio":
            await self._audio(call, output)
        else:
            await self._sse(call, output)

    async def _audio(self, call: _Call, output: _Chunks) -> None:
        """The bytes as they are made (a streamed header first, for
        ``wav``), the status with the first of them."""
        response = call.response
        media = MEDIA_TYPES[call.request.response_format]
        async with aclosing(_encoded(call, output)) as pieces:
            async for data in pieces:
                if not response.started:
                    await response.start_file_stream(media, data)
                else:
                    await response.send(data)
        if not response.started:  # no audio at all
            await response.start_file_stream(media, b"")
        await response.send(b"", more=False)

    async def _sse(self, call: _Call, output: _Chunks) -> None:
        """OpenAI's events: a delta of what the ``audio`` stream would send
        then, a piece at a time, then the usage."""
        response, log = call.response, call.log
        async with aclosing(_encoded(call, output)) as pieces:
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


async def _encoded(call: _Call, chunks: _Chunks) -> AsyncGenerator[bytes, None]:
    """The streamed answer's bytes as the pieces come, none empty: Opus is
    encoded in a worker thread, off the loop every stream waits on."""
    log = call.log
    encoder = StreamEncoder(call.request.response_format, call.engine.facts.sample_rate)
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
    """``chunk``, counted in ``log``: text tokens as the prompt's, audio frames
    as the completion's, the first piece's time as the first token's."""
    log.last_token = time.perf_counter()
    log.first_token = log.first_token or log.last_token
    log.prompt_tokens = chunk.input_tokens
    log.completion_tokens += chunk.frames
    return chunk


def _delta(audio: bytes) -> bytes:
    encoded = base64.b64encode(audio).decode("ascii")
    return sse_event({"type": "speech.audio.delta", "audio": encoded})
