"""The messages of an Anthropic Messages request, and the chat they make.
Pure CPU, any thread.

Every system text (the top-level one, then each ``system`` message, as
Claude Code sends them) is one leading system turn, as chat templates take
a system turn only first; ``tool_result`` blocks are tool turns before the
rest of their user turn; earlier thinking blocks are left out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from ...config import ImageLimits
from ...media import ImageRef
from ..protocol_common import RequestModel, counted_image_refs

__all__ = [
    "AssistantMessage",
    "Base64Source",
    "CacheControl",
    "ImageBlock",
    "Message",
    "RedactedThinkingBlock",
    "RequestModel",
    "SystemMessage",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
    "URLSource",
    "UserMessage",
    "chat_messages",
    "image_parts",
    "image_refs",
    "system_text",
    "text_chars",
]


class CacheControl(RequestModel):
    """``cache_control``: accepted, without effect (the server's prompt
    cache reuses any shared prefix by itself)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(RequestModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        """The image as the decoders take it: a data URI, or its URL."""
        source = self.source
        if isinstance(source, URLSource):
            return source.url
        return f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(RequestModel):
    """A tool's result, answering the call ``tool_use_id``; ``is_error`` is
    accepted (chat templates have no place for it: its text says so)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


UserBlock = Annotated[
    TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")
]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class UserMessage(RequestModel):
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


class SystemMessage(RequestModel):
    """A ``system`` message inside ``messages`` (Claude Code sends them)."""

    role: Literal["system"]
    content: str | list[TextBlock]


Message = Annotated[
    UserMessage | AssistantMessage | SystemMessage, Field(discriminator="role")
]
System = str | list[TextBlock]


def _text(content: str | Sequence[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def system_text(system: System | None, messages: Sequence[Message]) -> str:
    texts = [] if system is None else [_text(system)]
    texts += [_text(m.content) for m in messages if isinstance(m, SystemMessage)]
    return "\n\n".join(t for t in texts if t)


def chat_messages(
    system: System | None, messages: Sequence[Message]
) -> list[dict[str, Any]]:
    """The request as mlx-vlm's chat messages; each image block becomes an
    ``image_url`` marker in place, so the image keeps its turn and position."""
    out: list[dict[str, Any]] = []
    leading = system_text(system, messages)
    if leading:
        out.append({"role": "system", "content": leading})
    for message in messages:
        if isinstance(message, SystemMessage):
            continue
        if isinstance(message, AssistantMessage):
            out.append(_assistant_turn(message))
            continue
        if isinstance(message.content, str):
            out.append({"role": "user", "content": message.content})
            continue
        rest: list[TextBlock | ImageBlock] = []
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                out.append(_tool_turn(block))
            else:
                rest.append(block)
        if rest:
            out.append({"role": "user", "content": _parts(rest)})
    return out


def _parts(blocks: Sequence[TextBlock | ImageBlock]) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": b.text}
        if isinstance(b, TextBlock)
        else {"type": "image_url"}
        for b in blocks
    ]


def _assistant_turn(message: AssistantMessage) -> dict[str, Any]:
    content = message.content
    turn: dict[str, Any] = {"role": "assistant", "content": _text(content)}
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": b.input},
        }
        for b in content
        if isinstance(b, ToolUseBlock)
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_turn(block: ToolResultBlock) -> dict[str, Any]:
    content = block.content
    value: str | list[dict[str, Any]]
    if content is None or isinstance(content, str):
        value = content or ""
    elif any(isinstance(b, ImageBlock) for b in content):
        value = _parts(content)
    else:
        value = _text(content)
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": value}


def image_parts(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """Each image of ``messages`` in prompt order: where it is in the
    request (``messages[1].content[0].source``), and its URL."""
    found: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, UserMessage) or isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, ImageBlock):
                found.append((f"{where}.source", block.url))
            elif isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                found += [
                    (f"{where}.content[{k}].source", part.url)
                    for k, part in enumerate(block.content)
                    if isinstance(part, ImageBlock)
                ]
    return found


def image_refs(messages: Sequence[Message], limits: ImageLimits) -> list[ImageRef]:
    """The images of ``messages`` in prompt order; an
    :class:`~...failures.ImageRefusedError` past ``limits.max_images``."""
    return counted_image_refs((url for _, url in image_parts(messages)), limits)


def text_chars(system: System | None, messages: Sequence[Message]) -> int:
    """Characters of text in the request's turns: what every chat template
    writes into the prompt (not images, nor tool calls, which a template
    may write in its own shorter form)."""
    total = len(system_text(system, messages))
    for message in messages:
        if isinstance(message, SystemMessage):
            continue
        content = message.content
        if isinstance(content, str):
            total += len(content)
            continue
        for block in content:
            if isinstance(block, TextBlock):
                total += len(block.text)
            elif isinstance(block, ToolResultBlock):
                total += len(_text(block.content or ""))
    return total
