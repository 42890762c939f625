"""What the event loop and the MLX thread hand each other for the embedding
kind: the request (:class:`EmbeddingParams`), its vectors
(:class:`Embeddings`) and the engine's protocol. Any thread (no MLX, no
Starlette)."""

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
    """An image among an embedding request's inputs, embedded alone as a
    user turn that holds it (as mlx-vlm's server embeds an image).

    Attributes:
        image: Which of the request's images (in the order given to
            :meth:`EmbeddingEngine.embed`).
    """

    image: int


@dataclass(frozen=True)
class EmbeddingParams:
    """What one embedding request needs: its inputs (or one conversation)
    and their width.

    Attributes:
        inputs: Each input, in order: a text (tokenized with the model's
            tokenizer and its special tokens), token ids (used as they
            are; each below the model's vocabulary size) or an image. Empty
            for a conversation.
        dimensions: Keep the first ``dimensions`` values of each vector and
            normalise again (a Matryoshka-trained model's shorter vectors);
            None: the model's own width.
        messages: A conversation embedded as one vector (vLLM's
            ``messages``), as the model's chat template reads it: each
            image a ``{"type": "image"}`` part in place, its image given
            to :meth:`EmbeddingEngine.embed` in the same order. Empty: the
            request embeds ``inputs``.
        add_generation_prompt: End the rendered conversation with the
            assistant's opening, as the chat template writes it.
    """

    inputs: tuple[str | tuple[int, ...] | ImageInput, ...]
    dimensions: int | None = None
    messages: tuple[Mapping[str, Any], ...] = ()
    add_generation_prompt: bool = False


@dataclass(frozen=True)
class Embeddings:
    """One request's vectors.

    Attributes:
        vectors: Each input's vector, in input order, as little-endian
            float32 bytes (what OpenAI's ``base64`` encoding sends).
        prompt_tokens: Tokens of all the inputs (padding excluded).
    """

    vectors: tuple[bytes, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingFacts:
    """What a loaded embedding model is, built by its engine at load.

    Attributes:
        vocab_size: Valid token ids are below it.
        max_input_tokens: Tokens of the longest input it embeds (special
            tokens included).
        width: Values in each of its vectors.
        matryoshka_dimensions: The widths it was trained to be cut to (empty:
            any up to ``width``); None: it was not, and takes no ``dimensions``.
        accepts_images: Whether it embeds images.
        has_chat_template: Whether it renders a conversation (``messages``).
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


@runtime_checkable
class EmbeddingEngine(Resident, Protocol):
    """A loaded embedding model as the HTTP side sees it."""

    @property
    def facts(self) -> EmbeddingFacts:
        """What the model is."""
        ...

    async def embed(
        self, params: EmbeddingParams, images: Sequence[Image.Image] = ()
    ) -> Embeddings:
        """Embed the inputs of ``params`` (its images from ``images``), or
        its conversation with ``images`` (decoded, in prompt order) as one
        vector.

        Event loop; the tokenizer and the model run on the MLX thread, the
        inputs of every request waiting then padded into shared forward
        passes; a conversation, and each image input, runs in a job of its
        own, one pass. Cancelling
        it drops the inputs not yet embedded.

        Raises:
            PromptTooLongError: An input over its ``max_input_tokens``; the
                message names it by its index.
            RequestError: An input of no tokens.
        """
        ...
