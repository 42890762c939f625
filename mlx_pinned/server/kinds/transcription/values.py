"""What the event loop and the MLX thread hand each other for a speech-to-
text model (the ``transcription`` kind), as plain values.

A shared module: no Starlette, no pydantic, no MLX. The HTTP side decodes
the uploaded file (:mod:`.inputs.audio`) and makes
:class:`TranscriptionParams`; the engine (on the MLX thread) transcribes it
a 30-second window at a time, each window a job of the thread (the other
models' work runs between two), and yields a :class:`Window` each. The HTTP
side knows the engine only through :class:`TranscriptionEngine`; ``app.py``
wires in the real one (:mod:`mlx_pinned.server.engine.transcription`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from ...media import Audio
from ...resident import Resident

__all__ = [
    "Segment",
    "Task",
    "TranscriptionEngine",
    "TranscriptionFacts",
    "TranscriptionParams",
    "Window",
    "Word",
]

#: Whisper's two tasks: the speech as spoken, or in English.
Task = Literal["transcribe", "translate"]


@dataclass(frozen=True)
class TranscriptionParams:
    """What one transcription needs.

    Attributes:
        audio: The decoded file, at the model's sample rate.
        task: ``transcribe`` or ``translate`` (into English).
        language: The spoken language's ISO-639-1 code; None: detected from
            the first window.
        prompt: Text the first window continues (names, spellings, style).
        temperature: The sampling temperature; 0: greedy, then higher
            temperatures where a window's answer fails Whisper's checks
            (too repetitive, too unlikely), as OpenAI's API does.
        words: Word-level timestamps as well as segments.
    """

    audio: Audio
    task: Task = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    words: bool = False


@dataclass(frozen=True)
class Word:
    """A word, with its time in the file (seconds) and its probability
    (None where the family gives none)."""

    word: str
    start: float
    end: float
    probability: float | None


@dataclass(frozen=True)
class Segment:
    """A segment of the transcript, as OpenAI's ``verbose_json`` gives it
    (times in seconds from the file's start); the decoding statistics are
    None for a family that does not compute them (Parakeet's)."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float | None
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None
    words: tuple[Word, ...] = ()


@dataclass(frozen=True)
class Window:
    """One window's transcript.

    Attributes:
        text: Its text (the segments' texts, joined).
        segments: Its segments, numbered on from the window before.
        language: The spoken language (given or detected).
        end: Where the window ends in the file (seconds).
    """

    text: str
    segments: tuple[Segment, ...]
    language: str
    end: float


@dataclass(frozen=True, slots=True)
class TranscriptionFacts:
    """What a loaded speech-to-text model is, built by its engine at load.

    Attributes:
        sample_rate: The sample rate it takes (Hz).
        options: What a request may ask of it beside the file: ``language``,
            ``prompt``, ``temperature``, ``words`` (word timestamps).
        languages: The languages it knows: each ISO-639-1 code's name; one
            (``en``) for an English-only model, which cannot translate.
    """

    sample_rate: int
    options: frozenset[str]
    languages: Mapping[str, str]

    def card(self) -> dict[str, Any]:
        return {"languages": sorted(self.languages)}


@runtime_checkable
class TranscriptionEngine(Resident, Protocol):
    """A loaded speech-to-text model as the HTTP side sees it."""

    @property
    def facts(self) -> TranscriptionFacts:
        """What the model is."""
        ...

    def transcribe(self, params: TranscriptionParams) -> AsyncGenerator[Window]:
        """Each window's transcript, in order. Event loop; closing the
        iterator (a client gone) stops before the next window."""
        ...
