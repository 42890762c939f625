"""What the event loop and the MLX thread hand each other for the
transcription kind (speech to text), and its engine's protocol. Any thread
(no MLX, no Starlette)."""

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
    """What one transcription needs: the decoded file at the model's rate,
    its ISO-639-1 ``language`` (None: detected), the text the first window
    continues (``prompt``), a ``temperature`` (0: greedy, then higher where a
    window fails Whisper's checks, as OpenAI's API does), word timestamps."""

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
    """One window's transcript: its segments (numbered on from the window
    before) and their text, its language (given or detected), and where it
    ends in the file (seconds)."""

    text: str
    segments: tuple[Segment, ...]
    language: str
    end: float


@dataclass(frozen=True, slots=True)
class TranscriptionFacts:
    """What a loaded speech-to-text model is, built by its engine at load.

    Attributes:
        options: What a request may ask of it beside the file (``language``,
            ``prompt``, ``temperature``, ``words``).
        languages: Each ISO-639-1 code's name; only ``en`` for an
            English-only model, which cannot translate.
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
    def facts(self) -> TranscriptionFacts: ...

    def transcribe(self, params: TranscriptionParams) -> AsyncGenerator[Window]:
        """Each window's transcript, in order. Event loop; closing the
        iterator (a client gone) stops before the next window."""
        ...
