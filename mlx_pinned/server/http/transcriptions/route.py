"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``, in
OpenAI's shape.

Event loop. A :class:`~..endpoint.ModelEndpoint` of the transcription
kind: the base reads the body, keeps the deadline, watches the client,
holds the model named by ``model`` (404 for one not served, 400 for
another kind) and answers every error in OpenAI's shape, as the other
routes do. The file is decoded in a worker thread under the server's audio
limits (:mod:`...inputs.audio`), then the request takes a turn of its
model's gate and the engine transcribes it on the MLX thread, a window at
a time; a stream sends each window's text as it comes.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING, ClassVar, cast

from ...failures import AudioRefusedError
from ..endpoint import ModelEndpoint
from ..errors import APIError, api_error
from ..wire import sse_event
from .protocol import TranscriptionForm, TranslationForm, parse_form
from .serving import MEDIA_TYPES, Transcript, params, usage

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from ...config import ModelKind
    from ...media import LoadAudio
    from ...transcripts import Task, TranscriptionEngine, Window
    from ..wire import Body, RequestLog, ResponseWriter

__all__ = ["TranscriptionsEndpoint", "TranslationsEndpoint"]


class TranscriptionsEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /v1/audio/transcriptions``: the text
    (``json``: ``{"text", "usage"}``), or the transcript as ``text``,
    ``srt``, ``vtt`` or ``verbose_json``; with ``stream``, server-sent
    ``transcript.text.delta`` events and a ``transcript.text.done``."""

    route = "POST /v1/audio/transcriptions"
    kind: ClassVar[ModelKind] = "transcription"
    task: ClassVar[Task] = "transcribe"
    form: ClassVar[type[TranslationForm]] = TranscriptionForm
    #: Decodes the file under the server's limits (``app.py`` sets it).
    load_audio: LoadAudio

    def error_for(self, exc: BaseException, images: Sequence[str]) -> APIError | None:
        if isinstance(exc, AudioRefusedError):
            message = f"Invalid file: {exc.message}"
            return APIError(400, message, param="file", code=exc.code)
        return api_error(exc, retry_after=self.config.retry_after, prompt="file")

    async def handle(
        self, body: Body, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        form, data = await parse_form(body, body.content_type, self.form)
        async with self.resident(form.model, log) as (served, resident):
            engine = cast("TranscriptionEngine", resident)
            audio = await self.load_audio(data, engine.sample_rate)
            request = params(form, audio, engine, self.task)
            transcript = Transcript(self.task, dict(engine.languages), audio.seconds)
            log.stream = stream = getattr(form, "stream", False)
            windows = engine.transcribe(request)
            async with served.gate.turn(), aclosing(windows):
                if stream:
                    await _stream(windows, transcript, response, log)
                    return
                async for window in windows:
                    transcript.windows.append(window)
                    log.completion_tokens += _tokens(window)
            kind = form.response_format
            headers = [(b"content-type", MEDIA_TYPES[kind])]
            await response.whole(transcript.body(form), headers)


class TranslationsEndpoint(TranscriptionsEndpoint):
    """The ASGI endpoint of ``POST /v1/audio/translations``: the speech in
    English, in the same formats (no ``language``, no ``stream``)."""

    route = "POST /v1/audio/translations"
    task: ClassVar[Task] = "translate"
    form: ClassVar[type[TranslationForm]] = TranslationForm


async def _stream(
    windows: AsyncIterator[Window],
    transcript: Transcript,
    response: ResponseWriter,
    log: RequestLog,
) -> None:
    """Each window's text as a ``transcript.text.delta`` event as it comes,
    then the whole text and the usage in ``transcript.text.done``."""
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
    done = {
        "type": "transcript.text.done",
        "text": transcript.text,
        "usage": usage(transcript.seconds),
    }
    if not response.started:
        await response.start_stream(sse_event(done))
    else:
        await response.send(sse_event(done))
    await response.end()


def _tokens(window: Window) -> int:
    return sum(len(segment.tokens) for segment in window.segments)
