"""The parts of a chat-completions request body: messages and their content,
tools, tool choices and response formats, as pydantic models; and the
messages as what the engine and the image decoders take.

Pure CPU, no MLX, no event loop; :mod:`.protocol` assembles them into the
request and parses it. The engine gets mlx-vlm's chat messages
(:func:`chat_messages`), the image decoders :class:`~...events.ImageRef`
values (:func:`image_refs`), the audio decoder :class:`~...media.AudioRef`
values (:func:`audio_refs`); none sees pydantic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ...config import AudioLimits, ImageLimits, VideoLimits
from ...media import AudioRef, ImageRef, VideoRef
from ..protocol_common import counted_audio_refs, counted_image_refs, counted_video_refs

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

#: OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class RequestModel(BaseModel):
    """The base of every request model: strict types, finite numbers."""

    # strict: "10" is not an int and 1 is not a bool, as in OpenAI's API;
    # extra="ignore" inside the body (a message replayed from a response
    # carries 'refusal', 'annotations'...); the top level forbids extras;
    # allow_inf_nan=False: NaN and Infinity are "not a finite number", not
    # "should be less than or equal to 2".
    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, allow_inf_nan=False
    )


def _url_object(value: object) -> object:
    """A media part's URL string as the ``{"url": ...}`` object it stands for."""
    return {"url": value} if isinstance(value, str) else value


class TextPart(RequestModel):
    """A ``{"type": "text", "text": ...}`` content part."""

    type: Literal["text"]
    text: str


class Prediction(RequestModel):
    """``prediction``: the answer's expected text (OpenAI's predicted
    outputs), a string or text parts."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(p.text for p in content)


class ImageURL(RequestModel):
    """The ``image_url`` object of an image part; ``detail`` is accepted, unused."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(RequestModel):
    """A ``{"type": "image_url", "image_url": {"url": ...}}`` content part.

    ``image_url`` may also be the URL string itself.
    """

    type: Literal["image_url"]
    image_url: Annotated[ImageURL, BeforeValidator(_url_object)]


class VideoURL(RequestModel):
    """The ``video_url`` object of a video part."""

    url: str = Field(min_length=1)


class VideoPart(RequestModel):
    """A ``{"type": "video_url", "video_url": {"url": ...}}`` content part
    (vLLM's form); ``video_url`` may also be the URL string itself."""

    type: Literal["video_url"]
    video_url: Annotated[VideoURL, BeforeValidator(_url_object)]


class InputAudio(RequestModel):
    """The ``input_audio`` object of an audio part: the file's bytes in
    base64, and its format (OpenAI's two)."""

    data: str = Field(min_length=1)
    format: Literal["wav", "mp3"]


class AudioPart(RequestModel):
    """A ``{"type": "input_audio", "input_audio": {"data", "format"}}``
    content part (OpenAI's)."""

    type: Literal["input_audio"]
    input_audio: InputAudio


MediaPart = ImagePart | VideoPart | AudioPart
UserPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]
TextContent = str | Annotated[list[TextPart], Field(min_length=1)]


class SystemMessage(RequestModel):
    """A system (or ``developer``) message: text only."""

    role: Literal["system", "developer"]
    content: TextContent
    name: str | None = None


class UserMessage(RequestModel):
    """A user message: text, or a list of text, image, video and audio
    parts."""

    role: Literal["user"]
    content: str | Annotated[list[UserPart], Field(min_length=1)]
    name: str | None = None


class ToolCallFunction(RequestModel):
    """The ``function`` of an earlier tool call: name and JSON arguments."""

    name: str
    arguments: str


class ToolCall(RequestModel):
    """One of an earlier assistant turn's ``tool_calls``."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(RequestModel):
    """An earlier assistant turn: text, tool calls, or both."""

    role: Literal["assistant"]
    content: TextContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(RequestModel):
    """A tool's result, answering the call ``tool_call_id``."""

    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class StreamOptions(RequestModel):
    """``stream_options``: only ``include_usage`` has an effect."""

    include_usage: bool | None = None


class FunctionDefinition(RequestModel):
    """A tool's function: its name, and its arguments' JSON schema."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    """An entry of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(RequestModel):
    """``response_format.json_schema``: the schema the answer must follow."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # 'schema' would shadow a BaseModel attribute: the field has another name.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat,
    Field(discriminator="type"),
]


def chat_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Request messages as mlx-vlm's chat messages.

    Assistant turns keep their ``tool_calls`` and tool turns their
    ``tool_call_id``, as chat templates that take tools expect them. Image
    parts become ``{"type": "image_url"}`` markers in place, so mlx-vlm
    puts each image in the turn and position where it was sent; video parts
    ``{"type": "video"}`` markers, as Qwen-VL chat templates read them, and
    audio parts ``{"type": "audio"}`` markers, as Gemma's read them.
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
    return counted_image_refs((url for _, url in image_parts(messages)), limits)


def image_parts(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """Each image part of ``messages`` in prompt order: where it is in the
    request (``messages[1].content[0].image_url``), and its URL."""
    return [(w, p.image_url.url) for w, p in _parts_of(messages, ImagePart)]


def video_refs(
    messages: Sequence[Message],
    limits: VideoLimits,
    *,
    fps: float | None = None,
    max_frames: int | None = None,
) -> list[VideoRef]:
    """The video parts of ``messages`` in prompt order, each with the
    request's sampling; checks the count.

    Raises:
        VideoRefusedError: More than ``limits.max_videos`` videos.
    """
    urls = (url for _, url in video_parts(messages))
    return counted_video_refs(urls, limits, fps=fps, max_frames=max_frames)


def video_parts(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """Each video part of ``messages`` in prompt order: where it is in the
    request (``messages[1].content[0].video_url``), and its URL."""
    return [(w, p.video_url.url) for w, p in _parts_of(messages, VideoPart)]


def audio_refs(messages: Sequence[Message], limits: AudioLimits) -> list[AudioRef]:
    """The audio parts of ``messages`` in prompt order; checks the count.

    Raises:
        AudioRefusedError: More than ``limits.max_audios`` audio files.
    """
    parts = [part for _, part in _parts_of(messages, AudioPart)]
    files = ((p.input_audio.data, p.input_audio.format) for p in parts)
    return counted_audio_refs(files, limits)


def audio_parts(messages: Sequence[Message]) -> list[str]:
    """Where each audio part of ``messages`` is in the request, in prompt
    order (``messages[1].content[0].input_audio``)."""
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
    """Characters of text in ``messages`` (images, videos and audio not
    counted)."""
    total = 0
    for message in messages:
        content = message.content or ""
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(p.text) for p in content if isinstance(p, TextPart))
    return total
