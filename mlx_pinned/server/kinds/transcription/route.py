"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``, in
OpenAI's shape: the transcription kind's doors. Event loop; the file is
decoded in a worker thread, and a stream sends each window's text."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, TypeAlias

from ...http.door import Call, Door
from ...http.wire import Body, sse_event
from . import KIND
from .protocol import TranscriptionForm, TranslationForm, parse_form
from .serving import MEDIA_TYPES, Transcript, params
from .values import Task, TranscriptionEngine, TranscriptionParams, Window

if TYPE_CHECKING:
    from ...http.wire import RequestLog, ResponseWriter
    from ...media import Audio

__all__ = ["TranscriptionsEndpoint", "TranslationsEndpoint"]


@dataclass(frozen=True, slots=True)
class Upload:
    """A form checked against its model: the file's bytes, and its request
    once they are decoded (``params``)."""

    data: bytes
    make: Callable[[Audio], TranscriptionParams]
    params: TranscriptionParams | None = None


@dataclass(frozen=True, slots=True)
class Form:
    fields: TranslationForm
    data: bytes

    @property
    def model(self) -> str:
        return self.fields.model


_Call: TypeAlias = Call[Form, TranscriptionEngine, Upload]


class TranscriptionsEndpoint(
    Door[Form, TranscriptionEngine, Upload, AsyncIterator[Window]]
):
    route = "POST /v1/audio/transcriptions"
    api = "transcriptions"
    kind = KIND.name
    prompt = "file"
    task: ClassVar[Task] = "transcribe"
    form: ClassVar[type[TranslationForm]] = TranscriptionForm

    async def parse(self, body: Body, places: list[str]) -> Form:
        places.append("file")
        return Form(*await parse_form(body, body.content_type, self.form))

    def streamed(self, request: Form) -> bool:
        return isinstance(request.fields, TranscriptionForm) and request.fields.stream

    async def prepare(self, request: Form, engine: TranscriptionEngine) -> Upload:
        facts = engine.facts
        return Upload(request.data, params(request.fields, facts, self.task))

    async def media(
        self, prepared: Upload, engine: TranscriptionEngine, log: RequestLog
    ) -> Upload:
        audio = await self.wiring.decoders.audio(
            prepared.data, engine.facts.sample_rate
        )
        return replace(prepared, params=prepared.make(audio))

    @asynccontextmanager
    async def run(self, call: _Call) -> AsyncIterator[AsyncIterator[Window]]:
        assert call.prepared.params is not None, "media decoded it"
        async with aclosing(call.engine.transcribe(call.prepared.params)) as windows:
            yield windows

    def _transcript(self, call: _Call) -> Transcript:
        assert call.prepared.params is not None, "media decoded it"
        seconds = call.prepared.params.audio.seconds
        return Transcript(self.task, dict(call.engine.facts.languages), seconds)

    async def send_whole(self, call: _Call, output: AsyncIterator[Window]) -> None:
        transcript = self._transcript(call)
        async for window in output:
            transcript.windows.append(window)
            call.log.completion_tokens += _tokens(window)
        form = call.request.fields
        headers = [(b"content-type", MEDIA_TYPES[form.response_format])]
        await call.response.whole(transcript.body(form), headers)

    async def send_stream(self, call: _Call, output: AsyncIterator[Window]) -> None:
        await _stream(output, self._transcript(call), call.response, call.log)


class TranslationsEndpoint(TranscriptionsEndpoint):
    """The transcriptions' door, in English (no ``language``, no ``stream``)."""

    route = "POST /v1/audio/translations"
    api = "translations"
    task: ClassVar[Task] = "translate"
    form: ClassVar[type[TranslationForm]] = TranslationForm


async def _stream(
    windows: AsyncIterator[Window],
    transcript: Transcript,
    response: ResponseWriter,
    log: RequestLog,
) -> None:
    """Each window's text as a ``transcript.text.delta`` event as it comes,
    then the whole text in ``transcript.text.done``: with no ``usage``,
    which OpenAI's stream gives in tokens only (docs/audio.md)."""
    sent = 0
    async for window in windows:
        transcript.windows.append(window)
        log.completion_tokens += _tokens(window)
        text = "".join(w.text for w in transcript.windows).lstrip()
        event = sse_event({"type": "transcript.text.delta", "delta": text[sent:]})
        sent = len(text)
        if response.started:
            await response.send(event)
        else:
            await response.start_stream(event)
    done = {"type": "transcript.text.done", "text": transcript.text}
    if not response.started:
        await response.start_stream(sse_event(done))
    else:
        await response.send(sse_event(done))
    await response.end()


def _tokens(window: Window) -> int:
    return sum(len(segment.tokens) for segment in window.segments)
