"""The items of a Responses request: its ``input`` (messages, function
calls and their outputs, reasoning), its tools and tool choice, as pydantic
models; and the conversation as what the engine and the image decoders take.

Pure CPU, no MLX, no event loop; :mod:`.protocol` assembles them into the
request. The engine gets mlx-vlm's chat messages (:func:`chat_messages`);
neither it nor the image decoders see pydantic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

__all__ = [
    "INPUT_ITEMS",
    "NAME_PATTERN",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "HostedTool",
    "ImageContent",
    "InputItem",
    "MessageItem",
    "NamedFunctionChoice",
    "ReasoningItem",
    "RequestModel",
    "TextContent",
    "chat_messages",
    "image_urls",
    "text_chars",
]

#: OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class RequestModel(BaseModel):
    """The base of every request model: strict types, finite numbers.

    Inside the body, fields OpenAI adds to items it returns (``status``,
    ``annotations``, ``id``) are ignored, so an output item replayed as input
    is accepted; the top level forbids extras (:mod:`.protocol`).
    """

    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, allow_inf_nan=False
    )


class TextContent(RequestModel):
    """``input_text`` (a user's), ``output_text`` (an earlier answer's) or
    ``refusal`` content."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str | None = None


class ImageContent(RequestModel):
    """``input_image``: a data URL, or an ``http(s)`` URL where the server
    fetches them; ``file_id`` is refused (no files here)."""

    type: Literal["input_image"]
    image_url: str | None = Field(default=None, min_length=1)
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("file_id")
    @classmethod
    def _no_files(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server stores no files: send image_url instead")
        return value

    @model_validator(mode="after")
    def _url(self) -> ImageContent:
        if self.image_url is None and self.file_id is None:
            raise ValueError("an input_image needs its image_url")
        return self


Content = Annotated[TextContent | ImageContent, Field(discriminator="type")]


class MessageItem(RequestModel):
    """A message: text (a string, or ``input_text`` parts), and for a user,
    ``input_image`` parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[Content], Field(max_length=4096)]

    @field_validator("content")
    @classmethod
    def _images_from_users(
        cls, value: str | list[Content], info: Any
    ) -> str | list[Content]:
        if isinstance(value, list) and info.data.get("role") != "user":
            if any(isinstance(part, ImageContent) for part in value):
                raise ValueError("only user messages may hold images")
        return value


class FunctionCallItem(RequestModel):
    """An earlier answer's call of a function."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    """What a function call returned: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | Annotated[list[TextContent], Field(max_length=4096)]


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning; its text goes with the next answer."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default=[], max_length=4096)
    content: list[ReasoningText] | None = Field(default=None, max_length=4096)
    encrypted_content: str | None = None


def _item_type(value: Any) -> Any:
    """An item's ``type``; a message may leave it out (``{"role", "content"}``)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]

#: Validates a list of input items (an answer's output, replayed as input).
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


class FunctionTool(RequestModel):
    """A function the model may call (``tools`` entry ``type: function``)."""

    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def spec(self) -> dict[str, Any]:
        """As chat templates take a tool (chat completions' shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class HostedTool(BaseModel):
    """A tool this server cannot run (``web_search``, ``namespace``,
    ``file_search``, ``mcp``...): accepted, and not shown to the model."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    type: str

    @field_validator("type")
    @classmethod
    def _not_function(cls, value: str) -> str:
        if value == "function":
            raise ValueError("a function tool needs its 'name'")
        return value


class NamedFunctionChoice(RequestModel):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    name: str


def _text(content: str | Sequence[TextContent | ImageContent]) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        part.text or part.refusal or ""
        for part in content
        if isinstance(part, TextContent)
    )


def _arguments(text: str) -> Any:
    """A call's arguments as chat templates read them: an object when they
    are one, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def chat_messages(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Input items as mlx-vlm's chat messages.

    Function calls join the assistant turn before them (or make one), each
    output is a ``tool`` turn, and reasoning goes with the next assistant
    turn as its ``reasoning_content``. Image parts become
    ``{"type": "image_url"}`` markers in place.
    """
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            # Its text, or its summary; encrypted content alone says nothing
            # this server can read.
            parts = item.content or item.summary
            if text := "".join(part.text for part in parts):
                reasoning.append(text)
            continue
        if isinstance(item, FunctionCallOutputItem):
            turn = {"role": "tool", "content": _text(item.output)}
            out.append({**turn, "tool_call_id": item.call_id})
            continue
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {
                    "name": item.name,
                    "arguments": _arguments(item.arguments),
                },
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif item.role == "user" and not isinstance(item.content, str):
            content: list[dict[str, str]] = [
                {"type": "text", "text": part.text}
                if isinstance(part, TextContent)
                else {"type": "image_url"}
                for part in item.content
            ]
            out.append({"role": "user", "content": content})
            continue
        else:
            role = "system" if item.role == "developer" else item.role
            last = {"role": role, "content": _text(item.content)}
            out.append(last)
            if role != "assistant":
                continue
        if reasoning:
            last["reasoning_content"] = "".join(reasoning)
            reasoning = []
    return out


def image_urls(items: Sequence[InputItem]) -> list[tuple[str, str]]:
    """Each image of ``items`` in prompt order: where it is in the request
    (``input[1].content[0].image_url``), and its URL."""
    return [
        (f"input[{i}].content[{j}].image_url", part.image_url or "")
        for i, item in enumerate(items)
        if isinstance(item, MessageItem) and not isinstance(item.content, str)
        for j, part in enumerate(item.content)
        if isinstance(part, ImageContent)
    ]


def text_chars(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of text in chat ``messages`` (images not counted)."""
    total = 0
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(part.get("text", "")) for part in content)
        for call in message.get("tool_calls", ()):
            total += len(json.dumps(call["function"]["arguments"]))
    return total
