"""What the event loop and the MLX thread hand each other for the speech
kind of model (text to speech), as plain values.

A shared module: no Starlette, no pydantic, no MLX. The HTTP side turns a
request into :class:`SpeechParams`; the engine (on the MLX thread, one
generation at a time per model) answers with a stream of
:class:`SpeechChunk`, 16-bit PCM as it is made. The HTTP side knows the
engine only through its protocol, :class:`SpeechEngine`; ``app.py`` wires
the real one in (:mod:`mlx_pinned.server.engine.speech`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...resident import Resident

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

__all__ = ["SpeechChunk", "SpeechEngine", "SpeechFacts", "SpeechParams"]


@dataclass(frozen=True)
class SpeechParams:
    """What one speech request needs.

    Attributes:
        text: The text to speak (not empty).
        voice: One of the engine's its facts' ``voices``.
        instructions: How to speak it (tone, style), for a model that
            takes them; None: as the voice
            does.
        speed: How fast, 1.0 the voice's own; other than 1.0 only for a
            model that takes it.
    """

    text: str
    voice: str
    instructions: str | None = None
    speed: float = 1.0


@dataclass(frozen=True)
class SpeechChunk:
    """A piece of one request's audio, in the order it was made.

    Attributes:
        pcm: Mono 16-bit little-endian samples at the engine's
            sample rate (what OpenAI's ``pcm`` format
            sends).
        frames: The model's audio frames (its output tokens) this piece was
            made from.
        input_tokens: Tokens of the request's text (the same in every piece).
    """

    pcm: bytes
    frames: int
    input_tokens: int


@dataclass(frozen=True, slots=True)
class SpeechFacts:
    """What a loaded text-to-speech model is, built by its engine at load.

    Attributes:
        sample_rate: Samples a second of its audio.
        voices: The voices it speaks with, by name (lower case).
        takes_instructions: Whether it is steered by ``instructions``.
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
    def facts(self) -> SpeechFacts:
        """What the model is."""
        ...

    def speak(self, params: SpeechParams) -> AsyncGenerator[SpeechChunk, None]:
        """Speak ``params``: its audio, piece by piece as it is made.

        Event loop; the model runs on the MLX thread, a piece per job, so
        other work (a chat stream's steps) runs between pieces, and one
        model speaks for one request at a time (the others wait their
        turn). Closing the iterator (``aclose``, or cancelling its consumer)
        stops the generation on the MLX thread before its next piece; a
        consumer that reads slowly holds it after a few pieces.

        Raises:
            MLXThreadBusyError: The MLX thread's queue is full.
        """
        ...
