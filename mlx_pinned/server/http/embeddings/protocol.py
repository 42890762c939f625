"""The body of OpenAI's ``POST /v1/embeddings``, as a pydantic model.

Any thread (pure CPU, no MLX); the route parses on the event loop.
``input`` is a text, a list of texts, token ids, or a list of lists of
token ids (none empty, at most :data:`MAX_INPUTS`, as OpenAI's API allows);
``encoding_format`` is ``float`` or ``base64`` (little-endian float32, as
OpenAI's SDK decodes it); ``dimensions`` cuts a Matryoshka-trained model's
vectors short. Unknown fields are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ...encoders import EmbeddingParams
from ..protocol_common import RequestBody, TextsOrTokens
from ..validation import parse_request

__all__ = ["MAX_INPUTS", "EmbeddingRequest", "parse_embedding_request"]

#: Inputs one request may send (OpenAI's limit).
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    """The body of ``POST /v1/embeddings``."""

    model: str
    input: TextsOrTokens
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    # No effect on the output by definition: accepted, unused.
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, list) and isinstance(value[0], str | list):
            if len(value) > MAX_INPUTS:
                raise ValueError(
                    f"at most {MAX_INPUTS} inputs are allowed, not {len(value)}"
                )
        return value

    def inputs(self) -> tuple[str | tuple[int, ...], ...]:
        """The inputs, in order: texts or token ids."""
        value = self.input
        if isinstance(value, str):
            return (value,)
        if isinstance(value[0], int):
            return (tuple(value),)
        return tuple(item if isinstance(item, str) else tuple(item) for item in value)

    def to_embedding_params(self) -> EmbeddingParams:
        """The shared embedding request."""
        return EmbeddingParams(self.inputs(), self.dimensions)


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Parse and validate a ``/v1/embeddings`` body.

    Raises:
        APIError: 400 naming the first invalid parameter.
    """
    return parse_request(EmbeddingRequest, body)
