"""The body of OpenAI's ``POST /v1/embeddings``, as a pydantic model. Any
thread. Beside OpenAI's fields: vLLM's ``messages`` (a conversation embedded
as one vector) and ``add_generation_prompt``, and ``image_url`` parts among
the inputs, each its own vector, as mlx-vlm's server takes them."""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ...config import ImageLimits
from ...http.errors import APIError
from ...http.protocol_common import (
    ImagePart,
    RequestBody,
    RequestModel,
    TextPart,
    TextsOrTokens,
    counted_image_refs,
)
from ...http.validation import parse_request
from ...media import ImageRef
from .values import EmbeddingParams, ImageInput

__all__ = [
    "MAX_INPUTS",
    "EmbeddingMessage",
    "EmbeddingRequest",
    "parse_embedding_request",
]

#: Inputs one request may send (OpenAI's limit).
MAX_INPUTS = 2048


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]

TextsAndImages = Annotated[
    list[Annotated[str, Field(min_length=1)] | ImagePart], Field(min_length=1)
]


class EmbeddingMessage(RequestModel):
    """A turn of the conversation to embed: text, or text and image parts."""

    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[Part], Field(min_length=1)]


class EmbeddingRequest(RequestBody):
    """The body of ``POST /v1/embeddings``: ``input`` or ``messages``."""

    model: str
    input: TextsOrTokens | TextsAndImages | None = None
    messages: Annotated[list[EmbeddingMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    # No effect on the output by definition: accepted, unused.
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, list) and not isinstance(value[0], int):
            if len(value) > MAX_INPUTS:
                raise ValueError(
                    f"at most {MAX_INPUTS} inputs are allowed, not {len(value)}"
                )
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            # Text by OpenAI's definition, but never meant as text: say where
            # an image goes rather than embed its base64.
            if isinstance(item, str) and item.startswith("data:image/"):
                raise ValueError(
                    f"input {index} is an image as a data URI; send it as an "
                    '{"type": "image_url", "image_url": {"url": ...}} part'
                )
        return value

    def inputs(self) -> tuple[str | tuple[int, ...] | ImageInput, ...]:
        """The inputs, in order: texts, token ids or images (none for ``messages``)."""
        value = self.input
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value[0], int):
            return (tuple(value),)
        images = itertools.count()
        inputs: list[str | tuple[int, ...] | ImageInput] = []
        for item in value:
            if isinstance(item, ImagePart):
                inputs.append(ImageInput(next(images)))
            else:
                inputs.append(item if isinstance(item, str) else tuple(item))
        return tuple(inputs)

    def image_parts(self) -> list[tuple[str, str]]:
        """Each image part of ``input`` or ``messages``, in order: its place
        (``input[2].image_url``) and its URL."""
        if isinstance(self.input, list):
            return [
                (f"input[{index}].image_url", item.image_url.url)
                for index, item in enumerate(self.input)
                if isinstance(item, ImagePart)
            ]
        return [
            (f"messages[{turn}].content[{index}].image_url", part.image_url.url)
            for turn, message in enumerate(self.messages or ())
            if not isinstance(message.content, str)
            for index, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        ]

    def image_refs(self, limits: ImageLimits) -> list[ImageRef]:
        """The images of ``input`` or ``messages``, in order; an
        ImageRefusedError past ``limits.max_images``."""
        return counted_image_refs((url for _, url in self.image_parts()), limits)

    def to_embedding_params(self) -> EmbeddingParams:
        return EmbeddingParams(
            self.inputs(),
            self.dimensions,
            tuple(_turn(message) for message in self.messages or ()),
            self.add_generation_prompt,
        )


def _turn(message: EmbeddingMessage) -> dict[str, Any]:
    """A turn as chat templates read it: each image a ``{"type": "image"}``
    part in place (as mlx-vlm's server writes an image to embed)."""
    content = message.content
    if isinstance(content, str):
        return {"role": message.role, "content": content}
    parts = [
        {"type": "text", "text": part.text}
        if isinstance(part, TextPart)
        else {"type": "image"}
        for part in content
    ]
    return {"role": message.role, "content": parts}


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Parse and validate a ``/v1/embeddings`` body; a 400 :class:`APIError`
    names the first invalid parameter."""
    request = parse_request(EmbeddingRequest, body)
    if request.input is not None and request.messages is not None:
        why = "send either 'input' (texts or token ids) or 'messages', not both"
        raise APIError(
            400, f"Invalid request: {why}.", param="messages", code="invalid_value"
        )
    if request.input is None and request.messages is None:
        why = "send 'input' (texts or token ids) or 'messages' (a conversation)"
        raise APIError(
            400,
            f"Missing required parameter: {why}.",
            param="input",
            code="missing_required_parameter",
        )
    if request.add_generation_prompt and request.messages is None:
        why = "it shapes a conversation; send it with 'messages'"
        raise APIError(
            400,
            f"Invalid parameter 'add_generation_prompt': {why}.",
            param="add_generation_prompt",
            code="invalid_value",
        )
    return request
