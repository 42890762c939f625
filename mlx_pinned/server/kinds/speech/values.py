"""What the event loop and the MLX thread hand each other for the speech
kind (text to speech), and its engine's protocol. Any thread (no MLX, no
Starlette)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...resident import Resident

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

__all__ = ["SpeechChunk", "SpeechEngine", "SpeechFacts", "SpeechParams"]


@dataclass(frozen=True)
class SpeechParams:
    """What one speech request needs: ``voice`` is one of the model's;
    ``instructions`` (tone, style; None: as the voice speaks) and a ``speed``
    other than 1.0 only for a model that takes them."""

    text: str
    voice: str
    instructions: str | None = None
    speed: float = 1.0


@dataclass(frozen=True)
class SpeechChunk:
    """A piece of one request's audio, in the order it was made: mono 16-bit
    little-endian samples at the model's rate (OpenAI's ``pcm``), the audio
    frames (output tokens) it was made from, and the text's tokens (the same
    in every piece)."""

    pcm: bytes
    frames: int
    input_tokens: int


@dataclass(frozen=True, slots=True)
class SpeechFacts:
    """What a loaded text-to-speech model is, built by its engine at load.

    Attributes:
        voices: Its voices' names, lower case.
        takes_speed: Whether it speaks at a ``speed`` other than 1.0.
    """

    sample_rate: int
    voices: tuple[str, ...]
    takes_instructions: bool
    takes_speed: bool

    def card(self) -> dict[str, Any]:
        return {"voices": list(self.voices)}


@runtime_checkable
class SpeechEngine(Resident, Protocol):
    """A loaded text-to-speech model as the HTTP side sees it."""

    @property
    def facts(self) -> SpeechFacts: ...

    def speak(self, params: SpeechParams) -> AsyncGenerator[SpeechChunk, None]:
        """Speak ``params``, piece by piece as the audio is made. Event loop;
        a model speaks for one request at a time. Closing the iterator stops
        the generation before its next piece; a slow reader holds it."""
        ...
