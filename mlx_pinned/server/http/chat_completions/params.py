"""A validated request, turned into what the engine and the decoders take.

Event loop, pure Python: the wire schema stops here. The engine gets
:class:`~..events.GenerationParams` with mlx-vlm's chat messages, the image
decoders get :class:`~..events.ImageRef` values; neither sees pydantic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...config import ImageLimits
from ...events import GenerationParams, Grammar, ImageRef
from .messages import (
    AssistantMessage,
    ImagePart,
    Message,
    SystemMessage,
    TextPart,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from .protocol import ChatCompletionRequest

__all__ = [
    "chat_messages",
    "generation_params",
    "image_parts",
    "image_refs",
    "text_chars",
]

_TOP_P_FLOOR = 1.1754943508222875e-38  # float32's smallest normal number


def generation_params(
    request: ChatCompletionRequest,
    max_tokens: int,
    *,
    max_prompt_tokens: int | None = None,
    context_length: int | None = None,
    grammar: Grammar | None = None,
) -> GenerationParams:
    """The parameters of a validated request, with ``max_tokens`` resolved
    and its ``grammar`` (:func:`.structured.request_grammar`) checked.

    Tools go to the chat template unless ``tool_choice`` is ``none`` (the
    model is not told of tools it may not call).
    """
    top_k = request.top_k
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
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1: no limit
        min_p=request.min_p or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=(
            1.0 if request.repetition_penalty is None else request.repetition_penalty
        ),
        grammar=grammar,
        tools=tuple(
            tool.model_dump(exclude_none=True) for tool in request.active_tools
        ),
        template_kwargs=tuple((request.chat_template_kwargs or {}).items()),
    )


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Request messages as mlx-vlm's chat messages.

    Assistant turns keep their ``tool_calls`` and tool turns their
    ``tool_call_id``, as chat templates that take tools expect them. Image
    parts become ``{"type": "image_url"}`` markers in place, so mlx-vlm
    puts each image in the turn and position where it was sent.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, (SystemMessage, AssistantMessage, ToolMessage)):
            content = message.content or ""
            if not isinstance(content, str):
                content = "".join(part.text for part in content)
            role = "system" if isinstance(message, SystemMessage) else message.role
            turn: dict[str, Any] = {"role": role, "content": content}
            if isinstance(message, ToolMessage):
                turn["tool_call_id"] = message.tool_call_id
            elif isinstance(message, AssistantMessage) and message.tool_calls:
                turn["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
            out.append(turn)
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


def _tool_call(call: ToolCall) -> dict[str, Any]:
    """An earlier tool call as chat templates that take tools read it:
    its arguments as an object when they are one, else the text."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def image_refs(messages: Sequence[Message], limits: ImageLimits) -> list[ImageRef]:
    """The image parts of ``messages`` in prompt order; checks the count.

    Raises:
        ImageRefusedError: More than ``limits.max_images`` images.
    """
    parts = image_parts(messages)
    refs = [ImageRef(index, url) for index, (_, url) in enumerate(parts)]
    if len(refs) > limits.max_images:
        raise refs[limits.max_images].error(
            f"too many images: {len(refs)} in this request, at most "
            f"{limits.max_images} are allowed.",
            "too_many_images",
        )
    return refs


def image_parts(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """Each image part of ``messages`` in prompt order: where it is in the
    request (``messages[1].content[0].image_url``), and its URL."""
    return [
        (f"messages[{i}].content[{j}].image_url", part.image_url.url)
        for i, message in enumerate(messages)
        if isinstance(message, UserMessage) and not isinstance(message.content, str)
        for j, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]


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
