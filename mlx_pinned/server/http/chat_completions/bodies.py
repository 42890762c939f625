"""Response bodies of the OpenAI chat-completions API, and their stream chunks.

Event loop (pure CPU): built once per answer, or once per chunk through
:class:`ChunkEncoder`. Field order and nulls follow what OpenAI sends.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from ..vllm_extensions import StopReason, StopReasonChoice, VLLMPromptLogprobs
from ..wire import random_hex, sse_event

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "ChunkEncoder",
    "CompletionTokensDetails",
    "Delta",
    "DeltaFunction",
    "DeltaToolCall",
    "FunctionCall",
    "ResponseMessage",
    "ResponseToolCall",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "WireFinishReason",
    "completion_id",
    "tool_call_id",
]

#: ``finish_reason`` on the wire: the engine's ``stop`` becomes
#: ``tool_calls`` when the answer holds tool calls.
WireFinishReason = Literal["stop", "length", "tool_calls"]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopLogprob(_Response):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    """The sampled token at a position, with its top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    """``choices[].logprobs``."""

    content: list[TokenLogprob] | None
    refusal: None = None


class PromptTokensDetails(_Response):
    """``usage.prompt_tokens_details``: prompt tokens the prompt cache held."""

    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    """``usage.completion_tokens_details``, for a request that sent a
    ``prediction``: its tokens the answer kept, and those it did not."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(_Response):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda details: details is None
    )


class FunctionCall(_Response):
    """The ``function`` of a tool call: its name and arguments (JSON text)."""

    name: str
    arguments: str


class ResponseToolCall(_Response):
    """One entry of ``message.tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(_Response):
    """``choices[].message`` of a non-streamed completion.

    ``tool_calls`` and ``reasoning_content`` appear only when the answer has
    them, as OpenAI leaves ``tool_calls`` out of a plain answer.
    """

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Choice(_Response, StopReasonChoice):
    """The one choice of a non-streamed completion."""

    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: WireFinishReason
    stop_reason: StopReason = None  # vLLM's


class ChatCompletion(_Response):
    """A non-streamed completion (``object: chat.completion``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None
    # vLLM's, only when asked for (left out otherwise).
    prompt_logprobs: VLLMPromptLogprobs | None = Field(
        default=None, exclude_if=lambda logprobs: logprobs is None
    )


class DeltaFunction(_Response):
    """The ``function`` of a tool call's delta: the name comes once, first;
    the arguments in fragments that join to the whole JSON text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """One tool call's piece in a delta: ``id`` and ``type`` with its first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(_Response):
    """``choices[].delta`` of a stream chunk; only the keys it sets are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(_Response, StopReasonChoice):
    """The one choice of a stream chunk; the last has ``finish_reason`` and
    ``stop_reason``."""

    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: WireFinishReason | None = None
    stop_reason: StopReason = None  # vLLM's, only with finish_reason


class ChatCompletionChunk(_Response):
    """A stream chunk (``object: chat.completion.chunk``).

    With ``include_usage`` every chunk carries ``"usage": null`` and the last
    one has no choices and the usage; without it, ``usage`` is left out.
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: None = None
    usage: Usage | None = None

    def to_sse(self, *, include_usage: bool) -> bytes:
        """This chunk as one ``data: ...`` server-sent event."""
        data = self.model_dump(exclude=None if include_usage else {"usage"})
        for choice in data["choices"]:  # a delta carries only the keys it sets
            choice["delta"] = _set_only(choice["delta"])
        return sse_event(data)


class ChunkEncoder:
    """The stream chunks of one completion, as server-sent events.

    The common chunk, a content delta, is written from a template: the
    bytes :meth:`ChatCompletionChunk.to_sse` makes for this completion,
    split around the content, so the two cannot differ (a test checks it).
    It runs once per token on the event loop, where pydantic per token
    would cost many times more (docs/benchmarks.md).
    """

    __slots__ = ("_head", "_include_usage", "_tail", "created", "id", "model")

    _MARK = "\x00content\x00"

    def __init__(self, id: str, created: int, model: str, *, include_usage: bool):
        self.id, self.created, self.model = id, created, model
        self._include_usage = include_usage
        template = self.chunk([ChunkChoice(delta=Delta(content=self._MARK))])
        mark = json.dumps(self._MARK).encode()
        self._head, found, self._tail = template.partition(mark)
        assert found, "the content mark is in the template"

    def content(self, text: str) -> bytes:
        """A chunk whose only choice's delta is ``{"content": text}``."""
        body = json.dumps(text, ensure_ascii=False).encode()
        return self._head + body + self._tail

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        """Any chunk of this completion."""
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        ).to_sse(include_usage=self._include_usage)


def completion_id() -> tuple[str, int]:
    """A fresh ``chatcmpl-…`` id and the ``created`` Unix time."""
    return f"chatcmpl-{random_hex(96)}", int(time.time())


def tool_call_id() -> str:
    """A fresh ``call_…`` id for a tool call."""
    return f"call_{random_hex(96)}"


def _set_only(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its None values, in nested objects and lists too."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            value = _set_only(value)
        elif isinstance(value, list):
            value = [_set_only(v) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out
