"""What the event loop and the MLX thread hand each other for an embedding
model, as plain values.

A shared module: no Starlette, no pydantic, no MLX. The HTTP side turns a
request into :class:`EmbeddingParams`; the engine (on the MLX thread, in
passes shared by every request waiting then) answers with
:class:`Embeddings`. The HTTP side knows the engine only through the
:class:`EmbeddingEngine` protocol; ``app.py`` wires the real one in
(:class:`mlx_pinned.server.engine.embedding.EmbeddingEngine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .events import Resident

__all__ = ["EmbeddingEngine", "EmbeddingParams", "Embeddings"]


@dataclass(frozen=True)
class EmbeddingParams:
    """What one embedding request needs: its inputs and their width.

    Attributes:
        inputs: Each input, in order: a text (tokenized with the model's
            tokenizer and its special tokens) or token ids (used as they
            are; each below the model's vocabulary size).
        dimensions: Keep the first ``dimensions`` values of each vector and
            normalise again (a Matryoshka-trained model's shorter vectors);
            None: the model's own width.
    """

    inputs: tuple[str | tuple[int, ...], ...]
    dimensions: int | None = None


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


class EmbeddingEngine(Resident, Protocol):
    """A loaded embedding model as the HTTP side sees it."""

    @property
    def vocab_size(self) -> int:
        """Valid token ids are below it."""
        ...

    @property
    def max_input_tokens(self) -> int:
        """Tokens of the longest input it embeds (special tokens included)."""
        ...

    @property
    def width(self) -> int:
        """Values in each of its vectors."""
        ...

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        """The widths it was trained to be cut to (empty: any up to
        :attr:`width`); None: it was not trained so, and takes no
        ``dimensions``."""
        ...

    async def embed(self, params: EmbeddingParams) -> Embeddings:
        """Embed the inputs of ``params``.

        Event loop; the tokenizer and the model run on the MLX thread, the
        inputs of every request waiting then padded into shared forward
        passes. Cancelling it drops the inputs not yet embedded.

        Raises:
            PromptTooLongError: An input over :attr:`max_input_tokens`; the
                message names it by its index.
            RequestError: An input of no tokens.
        """
        ...
