"""The parts of a chat-completions request body (messages, tools, tool
choices, response formats), and the messages as the engine and the media
decoders take them.

Pure CPU, any thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, Field

from ...config import AudioLimits, ImageLimits, VideoLimits
from ...media import AudioRef, ImageRef, VideoRef
from ..protocol_common import (
    NAME_PATTERN,
    ImagePart,
    ImageURL,
    JSONObjectFormat,
    RequestModel,
    StreamOptions,
    TextFormat,
    TextPart,
    counted_audio_refs,
    counted_image_refs,
    counted_video_refs,
    url_object,
)

__all__ = [
    "NAME_PATTERN",
    "AssistantMessage",
    "AudioPart",
    "FunctionDefinition",
    "ImagePart",
    "ImageURL",
    "InputAudio",
    "JSONObjectFormat",
    "JSONSchemaFormat",
    "JSONSchemaResponseFormat",
    "Message",
    "NamedFunction",
    "NamedToolChoice",
    "RequestModel",
    "ResponseFormat",
    "StreamOptions",
    "SystemMessage",
    "TextFormat",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolCallFunction",
    "ToolMessage",
    "UserMessage",
    "VideoPart",
    "VideoURL",
    "audio_parts",
    "audio_refs",
    "chat_messages",
    "image_parts",
    "image_refs",
    "text_chars",
    "video_parts",
    "video_refs",
]


class Prediction(RequestModel):
    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(p.text for p in content)


class VideoURL(RequestModel):
    url: str = Field(min_length=1)


class VideoPart(RequestModel):
    """vLLM's video part; ``video_url`` may also be the URL string itself."""

    type: Literal["video_url"]
    video_url: Annotated[VideoURL, BeforeValidator(url_object)]


class InputAudio(RequestModel):
    data: str = Field(min_length=1)
    format: Literal["wav", "mp3"]


class AudioPart(RequestModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


MediaPart = ImagePart | VideoPart | AudioPart
UserPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]
TextContent = str | Annotated[list[TextPart], Field(min_length=1)]


class SystemMessage(RequestModel):
    role: Literal["system", "developer"]
    content: TextContent
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: str | Annotated[list[UserPart], Field(min_length=1)]
    name: str | None = None


class ToolCallFunction(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: TextContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(RequestModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # 'schema' would shadow a BaseModel attribute: the field has another name.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JSONSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat,
    Field(discriminator="type"),
]


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Request messages as mlx-vlm's chat messages. Each media part becomes a
    marker in place (``image_url``; ``video``, as Qwen-VL chat templates read
    it; ``audio``, as Gemma's), so it keeps its turn and position."""
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
            parts = [_marker(part) for part in message.content]
            out.append({"role": "user", "content": parts})
    return out


_MARKERS: dict[type[MediaPart], str] = {
    ImagePart: "image_url",
    VideoPart: "video",
    AudioPart: "audio",
}


def _marker(part: TextPart | MediaPart) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    return {"type": _MARKERS[type(part)]}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    """An earlier tool call as chat templates read it: its arguments as an
    object when they are one, else the text."""
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
    return counted_image_refs((url for _, url in image_parts(messages)), limits)


def image_parts(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """Where each image part is (``messages[1].content[0].image_url``), and
    its URL, in prompt order."""
    return [(w, p.image_url.url) for w, p in _parts_of(messages, ImagePart)]


def video_refs(
    messages: Sequence[Message],
    limits: VideoLimits,
    *,
    fps: float | None = None,
    max_frames: int | None = None,
) -> list[VideoRef]:
    urls = (url for _, url in video_parts(messages))
    return counted_video_refs(urls, limits, fps=fps, max_frames=max_frames)


def video_parts(messages: Sequence[Message]) -> list[tuple[str, str]]:
    return [(w, p.video_url.url) for w, p in _parts_of(messages, VideoPart)]


def audio_refs(messages: Sequence[Message], limits: AudioLimits) -> list[AudioRef]:
    parts = [part for _, part in _parts_of(messages, AudioPart)]
    files = ((p.input_audio.data, p.input_audio.format) for p in parts)
    return counted_audio_refs(files, limits)


def audio_parts(messages: Sequence[Message]) -> list[str]:
    return [where for where, _ in _parts_of(messages, AudioPart)]


P = TypeVar("P", ImagePart, VideoPart, AudioPart)


def _parts_of(messages: Sequence[Message], media: type[P]) -> list[tuple[str, P]]:
    return [
        (f"messages[{i}].content[{j}].{part.type}", part)
        for i, message in enumerate(messages)
        if isinstance(message, UserMessage) and not isinstance(message.content, str)
        for j, part in enumerate(message.content)
        if isinstance(part, media)
    ]


def text_chars(messages: Sequence[Message]) -> int:
    total = 0
    for message in messages:
        content = message.content or ""
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(p.text) for p in content if isinstance(p, TextPart))
    return total
