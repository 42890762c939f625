"""What the APIs' request models share: refusals by name, checks of
``stop`` and ``chat_template_kwargs``, OpenAI's sampling fields, media
references counted against the limits.

Pure CPU, any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ..config import AudioLimits, ImageLimits, VideoLimits
from ..events import SamplingParams
from ..media import AudioRef, ImageRef, VideoRef

__all__ = [
    "EFFORT_BUDGETS",
    "NAME_PATTERN",
    "TEMPLATE_ARGUMENTS",
    "ImagePart",
    "ImageURL",
    "JSONObjectFormat",
    "OpenAISamplingFields",
    "RequestBody",
    "RequestModel",
    "Stop",
    "StreamOptions",
    "TemplateKwargs",
    "TextFormat",
    "TextPart",
    "TextsOrTokens",
    "TokenId",
    "check_service_tier",
    "check_stop",
    "check_template_kwargs",
    "check_unique_names",
    "counted_audio_refs",
    "counted_image_refs",
    "counted_video_refs",
    "floor_top_p",
    "refusing",
    "stop_tuple",
    "token_id",
    "unsupported",
    "unsupported_value",
    "url_object",
]

#: OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
#: A token id as a request sends it (below the vocabulary: the serving's check).
TokenId = Annotated[int, Field(ge=0)]
#: OpenAI's ``prompt`` (completions) and ``input`` (embeddings): a text, texts,
#: token ids, or lists of token ids; none of them empty.
TextsOrTokens = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)
    ]
)
#: Reasoning tokens per reasoning effort (chat's ``reasoning_effort``, the
#: Responses API's ``reasoning.effort``); None: no budget.
EFFORT_BUDGETS: Mapping[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": None,
}

_TOP_P_FLOOR = 1.1754943508222875e-38  # float32's smallest normal number

#: Keyword arguments the server passes to the chat template itself.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "messages",
        "return_dict",
        "tokenize",
        "tools",
    }
)


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


def url_object(value: object) -> object:
    return {"url": value} if isinstance(value, str) else value


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class ImageURL(RequestModel):
    """The ``image_url`` object of an image part; ``detail`` is accepted, unused."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(RequestModel):
    """An ``image_url`` content part; ``image_url`` may also be the URL
    string itself."""

    type: Literal["image_url"]
    image_url: Annotated[ImageURL, BeforeValidator(url_object)]


class RequestBody(BaseModel):
    """The base of a top-level body: strict types, finite numbers, unknown
    fields refused (see :class:`RequestModel`)."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, allow_inf_nan=False
    )


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` has an effect."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    include_usage: bool | None = None


def unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported_parameter", f"Unsupported parameter: '{field}': {why}."
    )


def unsupported_value(field: str, value: object, why: str) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported_value",
        f"Unsupported value: '{field}' does not support {value!r}: {why}.",
    )


def refusing(refused: Mapping[str, str], *, accept_false: bool = False) -> Any:
    """The field validator of the fields refused whenever set (``refused``
    maps each to why); with ``accept_false``, ``false`` is accepted as unset.

    Assign it in the class body: ``_refuse = refusing(_REFUSED)``.
    """

    def _refuse(cls: type[Any], value: Any, info: ValidationInfo) -> Any:
        if value is not None and not (accept_false and value is False):
            assert info.field_name is not None
            raise unsupported(info.field_name, refused[info.field_name])
        return value

    return field_validator(*refused)(classmethod(_refuse))


def check_service_tier(value: str | None) -> str | None:
    """OpenAI's ``service_tier``: only the tiers that mean this server's one."""
    if value not in (None, "auto", "default"):
        raise unsupported_value(
            "service_tier", value, "this server has one tier, 'default'"
        )
    return value


def check_stop(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else value or []
    if len(stops) > 4:
        raise ValueError("at most 4 stop sequences are allowed")
    if any(not s for s in stops):
        raise ValueError("stop sequences must not be empty")
    return value


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    for key in value or {}:
        if key in TEMPLATE_ARGUMENTS:
            raise ValueError(f"{key!r} is set by the server, not the request")
    return value


#: OpenAI's ``stop``, checked by :func:`check_stop`.
Stop = Annotated[str | list[str], AfterValidator(check_stop)]
#: ``chat_template_kwargs``, checked by :func:`check_template_kwargs`.
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(check_template_kwargs)]


def check_unique_names(names: list[str], what: str) -> None:
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"the {what} name {name!r} is given twice")


def token_id(key: str) -> int:
    """A ``logit_bias`` key's token id: "000...05" is 5, past int()'s limit."""
    return int(key.lstrip("0") or "0")


def floor_top_p(top_p: float | None) -> float | None:
    """``top_p`` at least float32's smallest normal number: a smaller one is
    0 in float32, which keeps no token at all; this one keeps the most likely
    token, as 1e-30 does."""
    return None if top_p is None else max(top_p, _TOP_P_FLOOR)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)]


class OpenAISamplingFields(RequestBody):
    """The sampling fields OpenAI's chat and legacy completions share, with
    vLLM's extensions, each with vLLM's meaning and default but where a
    comment says otherwise."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: Stop | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    # None: the special tokens' text is kept, as mlx-vlm gives it (the
    # server's format parsers read markers that are special tokens).
    skip_special_tokens: bool | None = None
    # Hugging Face's fast tokenizers (every one mlx-vlm loads) ignore it.
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    bad_words: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=64)]
        | None
    ) = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("keep at least 1 token, or -1 for the model's context")
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
            token = token_id(key)
            if token in seen:
                raise ValueError(
                    f"token id {token} is given twice ({seen[token]!r} and {key!r})"
                )
            seen[token] = key
        return value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)

    def sampling_params(
        self, *, logprobs: bool, top_logprobs: int, scored: int | None = None
    ) -> SamplingParams:
        """These fields as the one sampling value of a generation; ``scored``:
        the prompt's log-probabilities' alternatives, when not
        ``prompt_logprobs``'s."""
        top_k, repetition = self.top_k, self.repetition_penalty
        return SamplingParams(
            temperature=self.temperature,
            top_p=floor_top_p(self.top_p),
            top_k=0 if top_k == -1 else top_k,  # vLLM's -1: no limit
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition is None else repetition,
            logit_bias=tuple(
                (token_id(key), bias) for key, bias in (self.logit_bias or {}).items()
            ),
            logprobs=logprobs,
            top_logprobs=top_logprobs if logprobs else 0,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
            bad_words=tuple(self.bad_words or ()),
            prompt_logprobs=self.prompt_logprobs if scored is None else scored,
        )

    def generation_fields(self) -> dict[str, Any]:
        """The fields that shape the answer's text, and its priority, as the
        shared generation request's arguments."""
        return {
            "priority": self.priority,
            "stop": self.stop_sequences,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": bool(self.skip_special_tokens),
            "return_tokens_as_token_ids": bool(self.return_tokens_as_token_ids),
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }


R = TypeVar("R", ImageRef, VideoRef, AudioRef)


def counted_image_refs(urls: Iterable[str], limits: ImageLimits) -> list[ImageRef]:
    """Raises ``ImageRefusedError`` past ``limits.max_images``."""
    refs = [ImageRef(index, url) for index, url in enumerate(urls)]
    return _at_most(refs, limits.max_images, "image")


def counted_video_refs(
    urls: Iterable[str],
    limits: VideoLimits,
    *,
    fps: float | None,
    max_frames: int | None,
) -> list[VideoRef]:
    """Raises ``VideoRefusedError`` past ``limits.max_videos``."""
    refs = [VideoRef(i, url, fps, max_frames) for i, url in enumerate(urls)]
    return _at_most(refs, limits.max_videos, "video")


def counted_audio_refs(
    files: Iterable[tuple[str, str]], limits: AudioLimits
) -> list[AudioRef]:
    """An :class:`AudioRef` per ``(base64 data, format)``; raises
    ``AudioRefusedError`` past ``limits.max_audios``."""
    refs = [AudioRef(i, data, kind) for i, (data, kind) in enumerate(files)]
    return _at_most(refs, limits.max_audios, "audio")


def _at_most(refs: Sequence[R], most: int, kind: str) -> list[R]:
    if len(refs) > most:
        plural = "audio files" if kind == "audio" else f"{kind}s"
        raise refs[most].error(
            f"too many {plural}: {len(refs)} in this request, at most "
            f"{most} are allowed.",
            f"too_many_{kind}s",
        )
    return list(refs)
