"""Request, response and error bodies of the OpenAI chat-completions API.

Requests are parsed from the raw body with :func:`parse_chat_request`, which
turns every failure (bad JSON, wrong type, out of range) into an
:class:`APIError` that names the offending parameter the way OpenAI does
(``messages[0].content[1].image_url``). Unknown fields are ignored, as OpenAI
ignores them. Nothing here touches MLX or the event loop.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from ..events import FinishReason
from .validation import validation_error_to_api_error

__all__ = [
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "ChunkEncoder",
    "Delta",
    "ImagePart",
    "ImageURL",
    "Message",
    "ResponseMessage",
    "StreamOptions",
    "SystemMessage",
    "TextPart",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "UserMessage",
    "completion_id",
    "parse_chat_request",
]


class _Request(BaseModel):
    # strict: "10" is not an int and 1 is not a bool, as in OpenAI's API;
    # extra="ignore": fields this server does not know are accepted and ignored;
    # allow_inf_nan=False: NaN and Infinity are "not a finite number", not
    # "should be less than or equal to 2".
    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, allow_inf_nan=False
    )


class TextPart(_Request):
    """A ``{"type": "text", "text": ...}`` content part."""

    type: Literal["text"]
    text: str


class ImageURL(_Request):
    """The ``image_url`` object of an image part; ``detail`` is accepted, unused."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Request):
    """A ``{"type": "image_url", "image_url": {"url": ...}}`` content part.

    ``image_url`` may also be the URL string itself.
    """

    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_string(cls, value: object) -> object:
        return {"url": value} if isinstance(value, str) else value


UserPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class SystemMessage(_Request):
    """A system (or ``developer``) message: text only."""

    role: Literal["system", "developer"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None


class UserMessage(_Request):
    """A user message: text, or a list of text and image parts."""

    role: Literal["user"]
    content: str | Annotated[list[UserPart], Field(min_length=1)]
    name: str | None = None


class AssistantMessage(_Request):
    """An earlier assistant turn: text only (tool calls are not supported)."""

    role: Literal["assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage, Field(discriminator="role")
]


class StreamOptions(_Request):
    """``stream_options``: only ``include_usage`` has an effect."""

    include_usage: bool | None = None


class ChatCompletionRequest(_Request):
    """The body of ``POST /v1/chat/completions``."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(
        cls, value: dict[str, float] | None
    ) -> dict[str, float] | None:
        seen: dict[int, str] = {}
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids, not {key[:40]!r}")
            # No vocabulary has 10**10 tokens; and int() of a longer key
            # could pass Python's digit limit (4300): a ValueError, a 500.
            if len(key.lstrip("0")) > 10:
                raise ValueError(f"token id {key[:40]!r}... is not in any vocabulary")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be between -100 and 100, not {bias}")
            token = _token_id(key)
            if token in seen:
                raise ValueError(
                    f"token id {token} is given twice ({seen[token]!r} and {key!r})"
                )
            seen[token] = key
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

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings (empty when unset)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else the older ``max_tokens``, else None."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids (empty when unset)."""
        return {_token_id(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


# Responses. Field order and nulls follow what OpenAI sends.


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


class Usage(_Response):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(_Response):
    """``choices[].message`` of a non-streamed completion."""

    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class Choice(_Response):
    """The one choice of a non-streamed completion."""

    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(_Response):
    """A non-streamed completion (``object: chat.completion``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None


class Delta(_Response):
    """``choices[].delta`` of a stream chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Response):
    """The one choice of a stream chunk."""

    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


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
            choice["delta"] = {
                k: v for k, v in choice["delta"].items() if v is not None
            }
        body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return b"data: " + body.encode() + b"\n\n"


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


# Completion ids must be unique, not secret: drawn from a generator seeded once
# from the OS (per process, forks re-seeded), not a system call per request,
# which on the event loop also gives up the GIL.
_ids = random.Random(os.urandom(16))
if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(16)))


def completion_id() -> tuple[str, int]:
    """A fresh ``chatcmpl-…`` id and the ``created`` Unix time."""
    return f"chatcmpl-{_ids.getrandbits(96):024x}", int(time.time())


def _token_id(key: str) -> int:
    """A ``logit_bias`` key's token id: "000...05" is 5, past int()'s limit."""
    return int(key.lstrip("0") or "0")


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a chat-completions body.

    Runs wherever it is called (pure CPU, no MLX); cheap enough for the event loop
    for bodies within the server's size limit.

    Raises:
        APIError: 400 naming the first invalid parameter.
    """
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc, body, _FIELD_NAMES) from None


def _field_names() -> frozenset[str]:
    names: set[str] = set()
    for model in (
        ChatCompletionRequest,
        SystemMessage,
        UserMessage,
        AssistantMessage,
        TextPart,
        ImagePart,
        ImageURL,
        StreamOptions,
    ):
        names.update(model.model_fields)
    return frozenset(names)


_FIELD_NAMES = _field_names()
