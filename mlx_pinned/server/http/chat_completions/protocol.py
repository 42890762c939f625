"""Request bodies of the OpenAI chat-completions API (responses: :mod:`.bodies`).

Pure CPU, any thread. Every top-level field of OpenAI's reference is
honoured or refused with a 400 that names it; an unknown one is refused as
OpenAI refuses it, except the vLLM and vllm-mlx extensions declared here,
which are honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from ...events import GenerationParams, Grammar
from ..protocol_common import (
    EFFORT_BUDGETS,
    OpenAISamplingFields,
    TemplateKwargs,
    check_service_tier,
    check_unique_names,
    refusing,
    unsupported_value,
)
from ..validation import parse_request
from ..vllm_extensions import StructuredOutputFields
from .messages import (
    Message,
    NamedToolChoice,
    Prediction,
    ResponseFormat,
    StreamOptions,
    TextFormat,
    Tool,
    chat_messages,
)

__all__ = ["ChatCompletionRequest", "parse_chat_request"]

# Fields of OpenAI's reference this server refuses whenever they are set, and
# what to do instead.
_REFUSED = {
    "audio": "this server generates text only; leave it out",
    "function_call": "it is deprecated; use 'tool_choice'",
    "moderation": "this server runs no moderation; leave it out",
    "functions": "it is deprecated; use 'tools'",
    "web_search_options": "this server cannot search the web; leave it out",
}


class ChatCompletionRequest(OpenAISamplingFields, StructuredOutputFields):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    # vLLM's extensions, honoured (its sampling ones are shared).
    chat_template_kwargs: TemplateKwargs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # llama.cpp's: the prompt's progress in the stream, before its tokens.
    return_progress: bool = False
    # vllm-mlx's video sampling, honoured (the server's settings bound them).
    video_fps: float | None = Field(default=None, gt=0.0, le=60.0)
    video_max_frames: int | None = Field(default=None, ge=2)
    # No effect on the output by definition: accepted, unused.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    # Accepted at the one value this server has.
    store: bool | None = None
    service_tier: (
        Literal["auto", "default", "flex", "scale", "priority", "fast"] | None
    ) = None
    modalities: list[Literal["text", "audio"]] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # A thinking budget: vLLM's in tokens, or a level (EFFORT_BUDGETS).
    reasoning_effort: (
        Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None
    ) = None
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # Refused whenever set (_REFUSED says why).
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    moderation: Any = None
    web_search_options: Any = None

    _refuse = refusing(_REFUSED)

    @field_validator("continue_final_message")
    @classmethod
    def _check_continue(cls, value: bool, info: ValidationInfo) -> bool:
        # Declared after messages and add_generation_prompt, so this sees them.
        if not value:
            return value
        if info.data.get("add_generation_prompt"):
            raise ValueError(
                "it continues the final message; set add_generation_prompt "
                "to false with it"
            )
        messages = info.data.get("messages")
        if messages and messages[-1].role != "assistant":
            raise ValueError("the final message must be the assistant's to continue")
        return value

    @field_validator("add_special_tokens")
    @classmethod
    def _check_special(cls, value: bool) -> bool:
        if value:
            raise unsupported_value(
                "add_special_tokens",
                True,
                "the chat template adds the model's special tokens; leave it false",
            )
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported_value("store", True, "this server stores no completions")
        return value

    @field_validator("service_tier")
    @classmethod
    def _check_service_tier(cls, value: str | None) -> str | None:
        return check_service_tier(value)

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "audio" in value:
            raise unsupported_value(
                "modalities", "audio", "this server generates text only"
            )
        return value

    @field_validator("verbosity")
    @classmethod
    def _check_verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise unsupported_value(
                "verbosity",
                value,
                "this server cannot steer a model's verbosity; ask for it in "
                "the messages",
            )
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported: this server returns one choice")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A field validator (logprobs is validated before it), so the error
        # names 'top_logprobs' as its param.
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        check_unique_names([tool.function.name for tool in value or []], "function")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        # tools is validated first; absent from info.data if it was invalid.
        if value is None or "tools" not in info.data:
            return value
        tools: list[Tool] | None = info.data["tools"]
        if tools is None and value != "none":
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(value, NamedToolChoice):
            names = [tool.function.name for tool in tools or []]
            if value.function.name not in names:
                raise ValueError(
                    f"the function {value.function.name!r} is not one of the tools"
                )
        return value

    @field_validator("response_format")
    @classmethod
    def _check_response_format(
        cls, value: ResponseFormat | None, info: ValidationInfo
    ) -> ResponseFormat | None:
        # Declared after tool_choice, so this sees it: a forced tool call
        # and a JSON answer are two grammars for one text.
        choice = info.data.get("tool_choice")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and value is not None and not isinstance(value, TextFormat):
            raise ValueError(
                "a JSON response_format cannot be combined with a tool_choice "
                "that forces a tool call"
            )
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def active_tools(self) -> list[Tool]:
        if self.tools is None or self.tool_choice == "none":
            return []
        return self.tools

    @property
    def thinking_budget(self) -> int | None:
        """Most reasoning tokens: ``thinking_token_budget``, else the
        ``reasoning_effort`` level's; None: no budget."""
        if self.thinking_token_budget is not None:
            return self.thinking_token_budget
        if self.reasoning_effort is None:
            return None
        return EFFORT_BUDGETS[self.reasoning_effort]

    def to_generation_params(
        self,
        max_tokens: int,
        *,
        max_prompt_tokens: int | None = None,
        context_length: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationParams:
        """This request as the shared generation request, with ``max_tokens``
        resolved and its ``grammar`` checked. Under ``tool_choice: "none"``
        the model is not told of the tools."""
        return GenerationParams(
            messages=tuple(chat_messages(self.messages)),
            max_tokens=max_tokens,
            sampling=self.sampling_params(
                logprobs=bool(self.logprobs), top_logprobs=self.top_logprobs or 0
            ),
            **self.generation_fields(),
            max_prompt_tokens=max_prompt_tokens,
            context_length=context_length,
            grammar=grammar,
            tools=tuple(
                tool.model_dump(exclude_none=True) for tool in self.active_tools
            ),
            template_kwargs=tuple(self.template_kwargs().items()),
            prediction="" if self.prediction is None else self.prediction.text,
        )

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's keywords: ``chat_template_kwargs``, and the
        assistant prefill (vLLM's ``add_generation_prompt`` and
        ``continue_final_message``) where it is not the default."""
        kwargs = dict(self.chat_template_kwargs or {})
        if not self.add_generation_prompt:
            kwargs["add_generation_prompt"] = False
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Raises :class:`~..errors.APIError`, a 400 naming the first invalid
    parameter."""
    return parse_request(ChatCompletionRequest, body)
