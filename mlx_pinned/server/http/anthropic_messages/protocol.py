"""Request bodies of the Anthropic Messages API (its messages: :mod:`.content`).
Pure CPU, any thread. Each field of Anthropic's reference is honoured,
accepted where it has no effect, or refused with a 400 that names it
(docs/anthropic.md lists which); so is an unknown top-level field."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from ...events import GenerationParams, Grammar, SamplingParams
from ..protocol_common import RequestBody, floor_top_p, refusing, unsupported_value
from ..validation import parse_request
from .content import (
    CacheControl,
    Message,
    RequestModel,
    System,
    chat_messages,
)

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "Tool",
    "ToolChoice",
    "parse_count_request",
    "parse_messages_request",
]

#: The name rule of Anthropic's custom tools.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"


class Tool(RequestModel):
    """A custom tool: a name, and its input's JSON schema.

    ``defer_loading`` tools are left out of the prompt: without a tool
    search tool (which this server does not run) the model never sees them.
    Anthropic's server and client tools (``web_search_...``,
    ``bash_...``, ``text_editor_...``) are refused by ``type``.
    """

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    defer_loading: bool | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _check_type(cls, value: object) -> object:
        if value is not None and value != "custom":
            raise unsupported_value(
                "type",
                value,
                "this server runs no server or built-in tools; declare a custom "
                "tool with 'name' and 'input_schema' and run it yourself",
            )
        return value

    def spec(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's function shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        return {"type": "function", "function": function}


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(discriminator="type"),
]


class ThinkingEnabled(RequestModel):
    """Thinking on; ``budget_tokens`` is checked as Anthropic checks it, and
    the reasoning's closing marker is forced once the thinking has that
    many tokens."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


class ThinkingAdaptive(RequestModel):
    """The model decides: its chat template's own default."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive,
    Field(discriminator="type"),
]


class ContextEdit(RequestModel):
    """One of ``context_management.edits``: only ``clear_thinking`` edits
    are accepted, since earlier thinking never reaches the prompt here."""

    type: str
    keep: Any = None

    @field_validator("type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        if not value.startswith("clear_thinking_"):
            raise unsupported_value(
                "type",
                value,
                "this server edits no context; send the turns you want the "
                "model to see",
            )
        return value


class ContextManagement(RequestModel):
    edits: list[ContextEdit] | None = None


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    """``output_config``: ``format`` is honoured (a JSON schema the answer
    follows); ``effort`` only at ``high``, Anthropic's default, since this
    server cannot steer a model's effort."""

    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormat | None = None

    @field_validator("effort")
    @classmethod
    def _check_effort(cls, value: str | None) -> str | None:
        if value not in (None, "high"):
            raise unsupported_value(
                "effort",
                value,
                "this server cannot steer a model's effort; leave it out or "
                "send 'high'",
            )
        return value


class Metadata(RequestModel):
    user_id: str | None = None


# Fields of Anthropic's reference this server refuses whenever set.
_REFUSED = {
    "container": "this server runs no code-execution containers; leave it out",
    "mcp_servers": "this server connects to no MCP servers; leave it out",
    "inference_geo": "this server runs where it runs; leave it out",
}


class CountTokensRequest(RequestBody):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: System | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    # Without effect: the prompt cache reuses any shared prefix by itself.
    cache_control: CacheControl | None = None
    # Refused whenever set (_REFUSED says why).
    container: Any = None
    mcp_servers: Any = None
    inference_geo: Any = None

    _refuse = refusing(_REFUSED)

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()
        for tool in value or []:
            if tool.name in seen:
                raise ValueError(f"the tool name {tool.name!r} is given twice")
            seen.add(tool.name)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: ToolChoice | None, info: ValidationInfo
    ) -> ToolChoice | None:
        # tools is validated first; absent from info.data if it was invalid.
        if value is None or "tools" not in info.data:
            return value
        tools: list[Tool] | None = info.data["tools"]
        if isinstance(value, ToolChoiceAny | ToolChoiceTool) and not tools:
            raise ValueError(f"tool_choice {value.type!r} needs tools")
        if isinstance(value, ToolChoiceTool):
            named = [t for t in tools or [] if t.name == value.name]
            if not named:
                raise ValueError(f"the tool {value.name!r} is not one of the tools")
            if named[0].defer_loading:
                raise ValueError(f"the tool {value.name!r} is deferred")
        return value

    @property
    def active_tools(self) -> list[Tool]:
        """The tools the model may call and is told of: none with
        ``tool_choice: none``, and no deferred ones."""
        if self.tools is None or isinstance(self.tool_choice, ToolChoiceNone):
            return []
        return [tool for tool in self.tools if not tool.defer_loading]

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``thinking`` as the chat template's switch: ``enabled`` and
        ``disabled`` set ``enable_thinking``; ``adaptive`` (or none) leaves
        the template's default."""
        if isinstance(self.thinking, ThinkingEnabled):
            return {"enable_thinking": True}
        if isinstance(self.thinking, ThinkingDisabled):
            return {"enable_thinking": False}
        return {}

    @property
    def thinking_shown(self) -> bool:
        """Whether thinking blocks carry their text (``display`` not
        ``omitted``)."""
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled | ThinkingAdaptive):
            return thinking.display != "omitted"
        return True

    def prompt_params(
        self,
        max_tokens: int,
        *,
        max_prompt_tokens: int | None = None,
        context_length: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationParams:
        return GenerationParams(
            messages=tuple(chat_messages(self.system, self.messages)),
            max_tokens=max_tokens,
            max_prompt_tokens=max_prompt_tokens,
            context_length=context_length,
            grammar=grammar,
            tools=tuple(tool.spec() for tool in self.active_tools),
            template_kwargs=tuple(self.template_kwargs.items()),
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    metadata: Metadata | None = None
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    service_tier: Literal["auto", "standard_only"] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        if any(not s for s in value or []):
            raise ValueError("stop sequences must not be empty")
        return value

    def to_generation_params(
        self,
        max_tokens: int,
        *,
        max_prompt_tokens: int | None = None,
        context_length: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationParams:
        """This request as the shared generation request, with ``max_tokens``
        resolved and its ``grammar`` checked."""
        prompt = self.prompt_params(
            max_tokens,
            max_prompt_tokens=max_prompt_tokens,
            context_length=context_length,
            grammar=grammar,
        )
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=floor_top_p(self.top_p),
            top_k=self.top_k,
        )
        return replace(prompt, sampling=sampling, stop=tuple(self.stop_sequences or ()))


def parse_messages_request(body: bytes) -> MessagesRequest:
    """Raises :class:`~..errors.APIError`, a 400 naming the first invalid
    field."""
    return parse_request(MessagesRequest, body)


def parse_count_request(body: bytes) -> CountTokensRequest:
    """Raises :class:`~..errors.APIError`, a 400 naming the first invalid
    field."""
    return parse_request(CountTokensRequest, body)
