"""The request body of the OpenAI Responses API (``POST /v1/responses``).
Pure CPU, any thread. Every field of OpenAI's reference is honoured,
accepted without effect, or refused with a 400 that names it; so is an
unknown one."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from ...events import GenerationParams, Grammar, SamplingParams
from ..protocol_common import (
    EFFORT_BUDGETS,
    JSONObjectFormat,
    RequestBody,
    TextFormat,
    check_service_tier,
    check_unique_names,
    floor_top_p,
    refusing,
    unsupported_value,
)
from ..validation import parse_request
from .items import (
    NAME_PATTERN,
    FunctionTool,
    HostedTool,
    InputItem,
    MessageItem,
    NamedFunctionChoice,
    RequestModel,
)

__all__ = [
    "JSONObjectFormat",
    "JSONSchemaFormat",
    "Reasoning",
    "ResponsesRequest",
    "TextFormat",
    "TextOptions",
    "parse_responses_request",
]

#: ``include`` values accepted; none adds anything this server has.
_INCLUDE = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
]

_REFUSED = {
    "background": "this server answers in the foreground; leave it out",
    "conversation": "this server keeps no conversations; use previous_response_id",
    "prompt": "this server stores no prompt templates; send 'input'",
    "max_tool_calls": "this server cannot cap built-in tool calls; leave it out",
    "context_management": "this server never compacts a conversation; leave it "
    "out (a prompt past the model's context is a 400)",
    "moderation": "this server runs no moderation model; leave it out",
}


class JSONSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # 'schema' would shadow a BaseModel attribute: the field has another name.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextOptions(RequestModel):
    """``verbosity`` only at the one value this server has."""

    format: (
        Annotated[
            TextFormat | JSONObjectFormat | JSONSchemaFormat,
            Field(discriminator="type"),
        ]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(RequestModel):
    """``effort`` turns the model's thinking on or off where its chat template
    has the switch, and sets its thinking budget
    (:data:`~..protocol_common.EFFORT_BUDGETS`); ``summary`` is unused."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class PromptCacheOptions(RequestModel):
    """``implicit``, the prompt cache's one mode, and ``30m``, the one
    ``ttl`` (the default): what a request without them gets."""

    ttl: Literal["30m"] | None = None
    mode: Literal["implicit", "explicit"] | None = None

    @field_validator("mode")
    @classmethod
    def _check_mode(cls, value: str | None) -> str | None:
        if value == "explicit":
            raise unsupported_value(
                "prompt_cache_options.mode",
                value,
                "this server caches every prompt by prefix (implicit) and takes "
                "no cache breakpoints",
            )
        return value


class ResponsesRequest(RequestBody):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool | HostedTool], Field(max_length=128)] | None = (
        None
    )
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    include: Annotated[list[_INCLUDE], Field(max_length=16)] | None = None
    # No effect on the output by definition: accepted, unused.
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    client_metadata: Annotated[dict[str, Any], Field(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    user: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: (
        Literal["auto", "default", "flex", "scale", "priority", "fast"] | None
    ) = None
    # Refused whenever set (_REFUSED says why).
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None

    _refuse = refusing(_REFUSED, accept_false=True)

    @field_validator("service_tier")
    @classmethod
    def _check_service_tier(cls, value: str | None) -> str | None:
        return check_service_tier(value)

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise unsupported_value(
                "truncation",
                value,
                "this server never drops input; a prompt over the context is a 400",
            )
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(
        cls, value: list[FunctionTool | HostedTool] | None
    ) -> list[FunctionTool | HostedTool] | None:
        names = [tool.name for tool in value or [] if isinstance(tool, FunctionTool)]
        check_unique_names(names, "function")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: str | NamedFunctionChoice | None, info: ValidationInfo
    ) -> str | NamedFunctionChoice | None:
        if value is None or value == "none" or "tools" not in info.data:
            return value
        tools = info.data["tools"] or []
        names = [tool.name for tool in tools if isinstance(tool, FunctionTool)]
        if value == "required" and not names:
            raise ValueError("tool_choice 'required' needs function tools")
        if isinstance(value, NamedFunctionChoice) and value.name not in names:
            raise ValueError(f"the function {value.name!r} is not one of the tools")
        return value

    @field_validator("text")
    @classmethod
    def _check_text(
        cls, value: TextOptions | None, info: ValidationInfo
    ) -> TextOptions | None:
        if value is None:
            return value
        if value.verbosity not in (None, "medium"):
            raise unsupported_value(
                "text.verbosity",
                value.verbosity,
                "this server cannot steer a model's verbosity",
            )
        choice = info.data.get("tool_choice")
        forced = choice == "required" or isinstance(choice, NamedFunctionChoice)
        if forced and not isinstance(value.format, (TextFormat, type(None))):
            raise ValueError(
                "a JSON text.format cannot be combined with a tool_choice that "
                "forces a tool call"
            )
        return value

    @property
    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]

    @property
    def active_tools(self) -> list[FunctionTool]:
        return [] if self.tool_choice == "none" else self.function_tools

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``reasoning.effort`` as the chat template's thinking switch."""
        if self.reasoning is None or self.reasoning.effort is None:
            return {}
        return {"enable_thinking": self.reasoning.effort not in ("none", "minimal")}

    @property
    def thinking_budget(self) -> int | None:
        if self.reasoning is None or self.reasoning.effort is None:
            return None
        return EFFORT_BUDGETS[self.reasoning.effort]

    def to_generation_params(
        self,
        messages: tuple[dict[str, Any], ...],
        max_tokens: int,
        *,
        max_prompt_tokens: int | None = None,
        context_length: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationParams:
        """This request as the shared generation request, over the whole
        conversation (a stored one's turns, then this request's)."""
        return GenerationParams(
            messages=messages,
            max_tokens=max_tokens,
            sampling=SamplingParams(
                temperature=self.temperature, top_p=floor_top_p(self.top_p)
            ),
            max_prompt_tokens=max_prompt_tokens,
            context_length=context_length,
            grammar=grammar,
            tools=tuple(tool.spec() for tool in self.active_tools),
            template_kwargs=tuple(self.template_kwargs.items()),
        )


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Raises :class:`~..errors.APIError`, a 400 naming the first invalid
    parameter."""
    return parse_request(ResponsesRequest, body)
