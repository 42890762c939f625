"""What the event loop and the MLX thread hand each other for the embedding
kind, and its engine's protocol. Any thread (no MLX, no Starlette)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...resident import Resident

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "EmbeddingEngine",
    "EmbeddingFacts",
    "EmbeddingParams",
    "Embeddings",
    "ImageInput",
]


@dataclass(frozen=True)
class ImageInput:
    """An image input, embedded alone as a user turn that holds it; ``image``
    indexes the images given to :meth:`EmbeddingEngine.embed`."""

    image: int


@dataclass(frozen=True)
class EmbeddingParams:
    """What one embedding request needs: its ``inputs`` (texts, token ids or
    images), or ``messages``, a conversation embedded as one vector (each
    image a ``{"type": "image"}`` part); the width to cut each vector to
    (None: the model's own)."""

    inputs: tuple[str | tuple[int, ...] | ImageInput, ...]
    dimensions: int | None = None
    messages: tuple[Mapping[str, Any], ...] = ()
    add_generation_prompt: bool = False


@dataclass(frozen=True)
class Embeddings:
    """One request's vectors, in input order, as little-endian float32 bytes
    (what OpenAI's ``base64`` sends), and its inputs' tokens (no padding)."""

    vectors: tuple[bytes, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingFacts:
    """What a loaded embedding model is, built by its engine at load.

    Attributes:
        max_input_tokens: Tokens of its longest input, special tokens included.
        width: Values in each of its vectors.
        matryoshka_dimensions: The widths it was trained to be cut to (empty:
            any up to ``width``); None: it takes no ``dimensions``.
    """

    vocab_size: int
    max_input_tokens: int
    width: int
    matryoshka_dimensions: tuple[int, ...] | None
    accepts_images: bool
    has_chat_template: bool

    def card(self) -> dict[str, Any]:
        modalities = ["text", "image"] if self.accepts_images else ["text"]
        return {"dimensions": self.width, "input_modalities": modalities}

    def refuses_width(self, dimensions: int) -> str | None:
        """Why vectors cut to ``dimensions`` values would be poor, in words
        for a 400; None: they would not."""
        trained = self.matryoshka_dimensions
        if trained is None:
            return (
                "this model was not trained Matryoshka-style, so its vectors "
                f"cannot be cut short; leave it out for its {self.width} values"
            )
        if dimensions > self.width:
            return f"this model's vectors have {self.width} values"
        if trained and dimensions not in trained:
            listed = ", ".join(str(width) for width in trained)
            return f"this model was trained for {listed}"
        return None


@runtime_checkable
class EmbeddingEngine(Resident, Protocol):
    """A loaded embedding model as the HTTP side sees it."""

    @property
    def facts(self) -> EmbeddingFacts: ...

    async def embed(
        self, params: EmbeddingParams, images: Sequence[Image.Image] = ()
    ) -> Embeddings:
        """Embed the inputs of ``params`` (its images from ``images``), or
        its conversation with ``images`` (in prompt order) as one vector.
        Event loop; cancelling it drops the inputs not yet embedded.

        Raises:
            PromptTooLongError: An input (named by its index) or the
                conversation over ``max_input_tokens``.
            RequestError: An input of no tokens.
        """
        ...
