"""The prompt of a chat: the model's chat template over mlx-vlm's chat
messages. MLX thread (it reads the processor the model was loaded with)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import LoadedModel

__all__ = ["build_prompt"]


def build_prompt(
    loaded: LoadedModel,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    template_kwargs: Sequence[tuple[str, Any]] = (),
) -> str:
    """The prompt text from the model's chat template.

    Images in every turn count: the image markers stay in their own messages.
    A chat with videos goes to the chat template as it is, image and video
    markers in place (mlx-vlm's own formatting would move its videos ahead
    of the text).
    ``tools`` (OpenAI's tool definitions) and ``template_kwargs`` (a
    request's ``chat_template_kwargs``) reach the template as keyword
    arguments.
    """
    from mlx_vlm.prompt_utils import apply_chat_template, get_chat_template

    num_images = sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    )
    extra: dict[str, Any] = dict(template_kwargs)
    opened = bool(extra.pop("add_generation_prompt", True))
    if tools:
        extra["tools"] = list(tools)
    if any(
        part["type"] == "video"
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
    ):
        marked = [_marked(m) for m in messages]
        return str(get_chat_template(loaded.processor, marked, opened, **extra))
    prompt = apply_chat_template(
        loaded.processor,
        loaded.config,
        list(messages),
        add_generation_prompt=opened,
        num_images=num_images,
        **extra,
    )
    return str(prompt)


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    """A message as Qwen-VL chat templates read media: ``{"type": "image"}``."""
    content = message["content"]
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image"} if part["type"] == "image_url" else part for part in content
    ]
    return {**message, "content": parts}
