"""The prompt of a chat request: mlx-vlm's messages, the chat template, and
the token ids and image tensors ``stream_generate`` takes.

:func:`chat_messages` is pure Python (any thread); :func:`build_prompt` and
:func:`prepare_inputs` run on the MLX thread, since the image processor makes
MLX arrays.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .schemas import AssistantMessage, Message, SystemMessage, TextPart

if TYPE_CHECKING:
    from PIL import Image

    from .engine import LoadedModel

__all__ = ["build_prompt", "chat_messages", "prepare_inputs"]


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Request messages as mlx-vlm's chat messages; pure Python, any thread.

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


def build_prompt(loaded: LoadedModel, messages: Sequence[dict[str, Any]]) -> str:
    """The prompt text from the model's chat template; runs on the MLX thread.

    Images in every turn count: the image markers stay in their own messages.
    """
    from mlx_vlm.prompt_utils import apply_chat_template

    num_images = sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    )
    prompt = apply_chat_template(
        loaded.processor, loaded.config, list(messages), num_images=num_images
    )
    return str(prompt)


def prepare_inputs(
    loaded: LoadedModel, prompt: str, images: Sequence[Image.Image]
) -> dict[str, Any]:
    """Token ids and image tensors, as ``stream_generate`` would make them.

    Made here so the prompt's length is known before anything is prefilled;
    ``stream_generate`` takes them as they are.
    """
    utils = importlib.import_module("mlx_vlm.utils")
    model, processor = loaded.model, loaded.processor
    inputs = dict(
        utils.prepare_inputs(
            processor,
            images=list(images) or None,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=utils.should_add_special_tokens(
                model.config.model_type, processor
            ),
        )
    )
    inputs["mask"] = inputs.pop("attention_mask", None)
    inputs.setdefault("pixel_values", None)
    return inputs
