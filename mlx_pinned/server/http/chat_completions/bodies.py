"""Response bodies of the OpenAI chat-completions API, and their stream chunks.

Event loop (pure CPU): built once per answer, or once per chunk through
:class:`ChunkEncoder`. Field order and nulls follow what OpenAI sends.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from ..vllm_extensions import StopReason, StopReasonChoice, VLLMPromptLogprobs
from ..wire import random_hex, sse_event

if TYPE_CHECKING:
    from ...events import PromptProgress

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
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda details: details is None
    )


class FunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(_Response):
    """``tool_calls`` and ``reasoning_content`` appear only when the answer
    has them, as OpenAI leaves ``tool_calls`` out of a plain answer."""

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
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: WireFinishReason
    stop_reason: StopReason = None  # vLLM's


class ChatCompletion(_Response):
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
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(_Response):
    """Only the keys it sets are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(_Response, StopReasonChoice):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: WireFinishReason | None = None
    stop_reason: StopReason = None  # vLLM's, only with finish_reason


class ChatCompletionChunk(_Response):
    """With ``include_usage`` every chunk carries ``"usage": null`` and the
    last one has no choices and the usage; without it, ``usage`` is left out."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: None = None
    usage: Usage | None = None

    def to_sse(self, *, include_usage: bool) -> bytes:
        data = self.model_dump(exclude=None if include_usage else {"usage"})
        for choice in data["choices"]:  # a delta carries only the keys it sets
            choice["delta"] = _set_only(choice["delta"])
        return sse_event(data)


class ChunkEncoder:
    """The stream chunks of one completion, as server-sent events.

    A content delta, once per token on the event loop, is written from a
    template (what :meth:`ChatCompletionChunk.to_sse` makes, split around the
    content; a test checks they agree): pydantic per token costs far more.
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
        body = json.dumps(text, ensure_ascii=False).encode()
        return self._head + body + self._tail

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return self._chunk(choices, usage).to_sse(include_usage=self._include_usage)

    def _chunk(
        self, choices: list[ChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def progress(self, moved: PromptProgress) -> bytes:
        """llama.cpp's chunk of a prompt's progress (``return_progress``):
        no choices, and ``prompt_progress``."""
        data = self._chunk([]).model_dump(
            exclude=None if self._include_usage else {"usage"}
        )
        data["prompt_progress"] = {
            "total": moved.total,
            "cache": moved.cached,
            "processed": moved.processed,
            "time_ms": round(moved.seconds * 1e3),
        }
        return sse_event(data)


def completion_id() -> tuple[str, int]:
    return f"chatcmpl-{random_hex(96)}", int(time.time())


def tool_call_id() -> str:
    return f"call_{random_hex(96)}"


def _set_only(data: dict[str, Any]) -> dict[str, Any]:
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
