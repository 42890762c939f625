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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ...events import Resident

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

__all__ = ["SpeechChunk", "SpeechEngine", "SpeechParams"]


@dataclass(frozen=True)
class SpeechParams:
    """What one speech request needs.

    Attributes:
        text: The text to speak (not empty).
        voice: One of the engine's :attr:`~SpeechEngine.voices`.
        instructions: How to speak it (tone, style), for a model that
            :attr:`~SpeechEngine.takes_instructions`; None: as the voice
            does.
        speed: How fast, 1.0 the voice's own; other than 1.0 only for a
            model that :attr:`~SpeechEngine.takes_speed`.
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
            :attr:`~SpeechEngine.sample_rate` (what OpenAI's ``pcm`` format
            sends).
        frames: The model's audio frames (its output tokens) this piece was
            made from.
        input_tokens: Tokens of the request's text (the same in every piece).
    """

    pcm: bytes
    frames: int
    input_tokens: int


@runtime_checkable
class SpeechEngine(Resident, Protocol):
    """A loaded text-to-speech model as the HTTP side sees it."""

    @property
    def sample_rate(self) -> int:
        """Samples a second of its audio."""
        ...

    @property
    def voices(self) -> tuple[str, ...]:
        """The voices it speaks with, by name (lower case)."""
        ...

    @property
    def takes_instructions(self) -> bool:
        """Whether it is steered by ``instructions`` (else it takes none)."""
        ...

    @property
    def takes_speed(self) -> bool:
        """Whether it speaks at a ``speed`` other than 1.0."""
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
