"""The items of a Responses request (its ``input``, tools and tool choice),
and the conversation as the engine takes it. Pure CPU, any thread."""

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

from ..protocol_common import NAME_PATTERN, RequestModel

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


class TextContent(RequestModel):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str | None = None
    # An answer's, sent back as input: listed by input_items, unused.
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class ImageContent(RequestModel):
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
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | Annotated[list[TextContent], Field(max_length=4096)]


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
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
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def echo(self) -> dict[str, Any]:
        """As a response lists it: ``parameters`` and ``strict`` always
        (null where not given)."""
        fields = ("type", "name", "description", "parameters", "strict")
        return {name: getattr(self, name) for name in fields}

    def spec(self) -> dict[str, Any]:
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

    def echo(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    @field_validator("type")
    @classmethod
    def _not_function(cls, value: str) -> str:
        if value == "function":
            raise ValueError("a function tool needs its 'name'")
        return value


class NamedFunctionChoice(RequestModel):
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
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def chat_messages(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Input items as mlx-vlm's chat messages: function calls join the
    assistant turn before them (or make one), each output is a ``tool`` turn,
    and reasoning goes with the next assistant turn."""
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
    """Where each image is (``input[1].content[0].image_url``), and its URL,
    in prompt order."""
    return [
        (f"input[{i}].content[{j}].image_url", part.image_url or "")
        for i, item in enumerate(items)
        if isinstance(item, MessageItem) and not isinstance(item.content, str)
        for j, part in enumerate(item.content)
        if isinstance(part, ImageContent)
    ]


def text_chars(messages: Sequence[dict[str, Any]]) -> int:
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
