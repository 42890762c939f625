"""What the transcription doors make of a form and of the engine's windows:
the shared request, checked against the model, and the answer in each of
OpenAI's ``response_format``\\ s. Event loop; plain CPU."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...http.errors import APIError
from .protocol import TranscriptionForm, TranslationForm
from .values import Segment, Task, TranscriptionParams, Window

if TYPE_CHECKING:
    from ...media import Audio
    from .values import TranscriptionFacts

__all__ = ["Transcript", "params", "usage"]

MEDIA_TYPES = {
    "json": b"application/json",
    "verbose_json": b"application/json",
    "text": b"text/plain; charset=utf-8",
    "srt": b"application/x-subrip; charset=utf-8",
    "vtt": b"text/vtt; charset=utf-8",
}


def params(
    form: TranslationForm, facts: TranscriptionFacts, task: Task
) -> Callable[[Audio], TranscriptionParams]:
    """The shared request of ``form`` for the model of ``facts``, given its
    audio once decoded; a 400 names a field the model does not take."""
    language = None
    stream = False
    words = False
    if isinstance(form, TranscriptionForm):
        language, stream = form.language, form.stream
        granularities = form.timestamp_granularities
        if granularities and form.response_format != "verbose_json":
            raise APIError(
                400,
                "Invalid value for 'timestamp_granularities': timestamps come with "
                "response_format 'verbose_json' only.",
                param="timestamp_granularities",
                code="invalid_value",
            )
        words = "word" in granularities
    if stream and form.response_format not in ("json", "text"):
        raise APIError(
            400,
            "Invalid value for 'stream': a streamed transcript is text; use "
            f"response_format 'json' or 'text', not {form.response_format!r}.",
            param="stream",
            code="invalid_value",
        )
    asked = {
        "prompt": form.prompt is not None,
        "temperature": form.temperature != 0,
        "timestamp_granularities": words,
    }
    for name, given in asked.items():
        option = "words" if name == "timestamp_granularities" else name
        if given and option not in facts.options:
            raise APIError(
                400,
                f"Unsupported parameter: '{name}': model {form.model!r} does not "
                "take it (its family decodes greedily, without a prompt).",
                param=name,
                code="unsupported_parameter",
            )
    known = facts.languages
    if language is not None and language not in known:
        shown = ", ".join(sorted(known)[:12]) + (", ..." if len(known) > 12 else "")
        raise APIError(
            400,
            f"Invalid value for 'language': {language!r} is not one of this model's "
            f"languages (ISO-639-1 codes: {shown}).",
            param="language",
            code="invalid_value",
        )
    if task == "translate" and len(known) < 2:
        raise APIError(
            400,
            f"Invalid value for 'model': {form.model!r} transcribes English only and "
            "cannot translate; use /v1/audio/transcriptions.",
            param="model",
            code="invalid_value",
        )
    return functools.partial(
        TranscriptionParams,
        task=task,
        language=language,
        prompt=form.prompt,
        temperature=form.temperature,
        words=words,
    )


def usage(seconds: float) -> dict[str, Any]:
    """OpenAI's usage of a duration-billed model: whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(seconds)}


class Transcript:
    """The windows of one file, as they come, and the answer they make."""

    def __init__(self, task: Task, names: dict[str, str], seconds: float) -> None:
        self.task = task
        self.names = names
        self.seconds = seconds
        self.windows: list[Window] = []

    @property
    def text(self) -> str:
        return "".join(window.text for window in self.windows).strip()

    @property
    def segments(self) -> list[Segment]:
        return [segment for window in self.windows for segment in window.segments]

    def body(self, form: TranslationForm) -> bytes:
        kind = form.response_format
        if kind == "text":
            return (self.text + "\n").encode()
        if kind == "srt":
            return _cues(self.segments, srt=True).encode()
        if kind == "vtt":
            return ("WEBVTT\n\n" + _cues(self.segments, srt=False)).encode()
        answer: dict[str, Any] = {"text": self.text}
        if kind == "verbose_json":
            answer = self.verbose(form)
        answer["usage"] = usage(self.seconds)
        return json.dumps(answer, ensure_ascii=False).encode()

    def verbose(self, form: TranslationForm) -> dict[str, Any]:
        """OpenAI's ``verbose_json``: the language by name, the duration,
        the segments, and the words where they were asked for."""
        language = self.windows[0].language if self.windows else "en"
        if self.task == "translate":
            language = "en"
        segments = self.segments
        answer: dict[str, Any] = {
            "task": self.task,
            "language": self.names.get(language, language),
            "duration": round(self.seconds, 2),
            "text": self.text,
        }
        asked = getattr(form, "timestamp_granularities", ())
        if "word" in asked:
            answer["words"] = [
                {"word": word.word.strip(), "start": word.start, "end": word.end}
                for segment in segments
                for word in segment.words
            ]
        if not asked or "segment" in asked:
            answer["segments"] = [_segment(segment) for segment in segments]
        return answer


def _segment(segment: Segment) -> dict[str, Any]:
    return {
        "id": segment.id,
        "seek": segment.seek,
        "start": segment.start,
        "end": segment.end,
        "text": segment.text,
        "tokens": list(segment.tokens),
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }


def _cues(segments: Sequence[Segment], *, srt: bool) -> str:
    """SubRip's or WebVTT's cues: a number (SubRip's), the times, the text."""
    cues = []
    for number, segment in enumerate(segments, 1):
        times = f"{_time(segment.start, srt)} --> {_time(segment.end, srt)}"
        head = f"{number}\n{times}" if srt else times
        cues.append(f"{head}\n{segment.text.strip()}\n")
    return "\n".join(cues)


def _time(seconds: float, srt: bool) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    whole, millis = divmod(millis, 1000)
    mark = "," if srt else "."
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{mark}{millis:03d}"
