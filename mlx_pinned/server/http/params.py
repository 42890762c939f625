"""A validated request, turned into what the engine and the decoders take.

Event loop, pure Python: the wire schema stops here. The engine gets
:class:`~..events.GenerationParams` with mlx-vlm's chat messages, the image
decoders get :class:`~..events.ImageRef` values; neither sees pydantic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import ImageLimits
from ..events import GenerationParams, ImageRef
from .schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    ImagePart,
    Message,
    SystemMessage,
    TextPart,
    UserMessage,
)

__all__ = ["chat_messages", "generation_params", "image_refs", "text_chars"]

_TOP_P_FLOOR = 1.1754943508222875e-38  # float32's smallest normal number


def generation_params(
    request: ChatCompletionRequest,
    max_tokens: int,
    *,
    max_prompt_tokens: int | None = None,
    context_length: int | None = None,
) -> GenerationParams:
    """The parameters of a validated request, with ``max_tokens`` resolved."""
    return GenerationParams(
        messages=tuple(chat_messages(request.messages)),
        max_tokens=max_tokens,
        temperature=request.temperature,
        # At least float32's smallest normal number: a smaller top_p is 0 in
        # float32, which keeps no token at all; this one keeps the most
        # likely token, as 1e-30 does.
        top_p=None if request.top_p is None else max(request.top_p, _TOP_P_FLOOR),
        seed=request.seed,
        stop=request.stop_sequences,
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        logit_bias=tuple(request.token_bias.items()),
        max_prompt_tokens=max_prompt_tokens,
        context_length=context_length,
    )


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Request messages as mlx-vlm's chat messages.

    Image parts become ``{"type": "image_url"}`` markers in place, so mlx-vlm
    puts each image in the turn and position where it was sent.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, (SystemMessage, AssistantMessage)):
            role = "system" if isinstance(message, SystemMessage) else "assistant"
            content = message.content or ""
            if not isinstance(content, str):
                content = "".join(part.text for part in content)
            out.append({"role": role, "content": content})
        elif isinstance(message.content, str):
            out.append({"role": "user", "content": message.content})
        else:
            parts = [
                {"type": "text", "text": part.text}
                if isinstance(part, TextPart)
                else {"type": "image_url"}
                for part in message.content
            ]
            out.append({"role": "user", "content": parts})
    return out


def image_refs(messages: Sequence[Message], limits: ImageLimits) -> list[ImageRef]:
    """The image parts of ``messages`` in prompt order; checks the count.

    Raises:
        ImageError: More than ``limits.max_images`` images.
    """
    refs = [
        ImageRef(i, j, part.image_url.url)
        for i, message in enumerate(messages)
        if isinstance(message, UserMessage) and not isinstance(message.content, str)
        for j, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]
    if len(refs) > limits.max_images:
        raise refs[limits.max_images].error(
            f"too many images: {len(refs)} in this request, at most "
            f"{limits.max_images} are allowed.",
            "too_many_images",
        )
    return refs


def text_chars(request: ChatCompletionRequest) -> int:
    """Characters of text in the messages (images not counted)."""
    total = 0
    for message in request.messages:
        content = message.content or ""
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(p.text) for p in content if isinstance(p, TextPart))
    return total
