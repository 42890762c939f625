"""Request bodies of Ollama's API, as pydantic models. Pure CPU, any thread.

Each field of Ollama's reference is honoured, accepted where it has no
effect here (:data:`NO_EFFECT`: where the weights sit, how many threads run
them), or refused with a 400 that names it (docs/ollama.md lists which)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
)

from ...events import SamplingParams
from ..protocol_common import (
    RequestBody,
    RequestModel,
    floor_top_p,
    refusing,
    unsupported,
    unsupported_value,
)

__all__ = [
    "HONOURED",
    "NO_EFFECT",
    "ChatRequest",
    "EmbedRequest",
    "EmbeddingsRequest",
    "GenerateRequest",
    "Message",
    "Options",
    "ShowRequest",
    "keep_alive_seconds",
]

#: The options honoured, each as the generation's field of the same meaning.
HONOURED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "num_predict",
    "stop",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "num_ctx",
)
#: Ollama's options that place the weights or size the threads: accepted,
#: without effect on any answer.
NO_EFFECT = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "logits_all",
        "embedding_only",
        "num_keep",  # what a context shift keeps; no prompt is ever shifted
    }
)
# Options that would change the answer in ways this server cannot.
_REFUSED_OPTIONS = {
    "mirostat": "this server samples without Mirostat",
    "mirostat_tau": "this server samples without Mirostat",
    "mirostat_eta": "this server samples without Mirostat",
    "tfs_z": "this server has no tail-free sampling",
    "typical_p": "this server has no typical sampling",
    "penalize_newline": "this server penalizes no token on its own",
}
# Go's time.ParseDuration: an optional sign, then numbers with units.
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3}
_UNITS |= {"s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: object) -> float | None:
    """``keep_alive`` in seconds, as Ollama reads it: a number of seconds or
    a Go duration (``"5m"``, ``"1h30m"``, ``"0"``); a negative one is
    ``math.inf`` (keep it loaded)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("keep_alive must be a number of seconds or a duration")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body == "0":
            seconds = 0.0
        elif not body or _DURATION.sub("", body):
            raise ValueError(
                f"keep_alive {value!r} is not a duration such as '5m', '1h30m' "
                "or '0', nor a number of seconds"
            )
        else:
            seconds = sum(
                float(number) * _UNITS[unit] for number, unit in _DURATION.findall(body)
            )
        value = sign * seconds
    if not math.isfinite(value):
        raise ValueError("keep_alive must be finite")
    return math.inf if value < 0 else float(value)


KeepAlive = Annotated[
    Annotated[float, Field(allow_inf_nan=True)] | None,
    BeforeValidator(keep_alive_seconds),
]


class Options(RequestModel):
    """``options``: the honoured ones typed; an unknown one, or one that
    would change the answer in a way this server cannot, is refused."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, allow_inf_nan=False
    )

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    num_predict: int | None = Field(default=None, ge=-2)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    num_ctx: int | None = Field(default=None, ge=1)
    repeat_last_n: int | None = None
    # Accepted, no effect (NO_EFFECT says why).
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: int | None = None
    logits_all: bool | None = None
    embedding_only: bool | None = None
    num_keep: int | None = None
    # Refused whenever set (_REFUSED_OPTIONS says why).
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    tfs_z: Any = None
    typical_p: Any = None
    penalize_newline: Any = None

    _refuse = refusing(_REFUSED_OPTIONS)

    @field_validator("num_predict")
    @classmethod
    def _check_predict(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("generate at least 1 token, or -1 for no limit")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if any(not s for s in ([value] if isinstance(value, str) else value or [])):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("repeat_last_n")
    @classmethod
    def _check_window(cls, value: int | None) -> int | None:
        # The repetition penalty reads the whole prompt and answer so far.
        if value not in (None, -1):
            raise unsupported_value(
                "repeat_last_n",
                value,
                "repeat_penalty reads every token of the prompt and the answer "
                "so far here; send -1 or leave it out",
            )
        return value

    def sampling(self, *, logprobs: bool, top_logprobs: int) -> SamplingParams:
        """These options as the generation's sampling (``top_k`` 0: no
        limit, as Ollama's)."""
        repetition = self.repeat_penalty
        return SamplingParams(
            temperature=self.temperature,
            top_p=floor_top_p(self.top_p),
            top_k=self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition is None else repetition,
            logprobs=logprobs,
            top_logprobs=top_logprobs if logprobs else 0,
        )

    @property
    def stops(self) -> tuple[str, ...]:
        stop = self.stop
        return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


#: An image as Ollama sends it: base64, with no ``data:`` prefix.
Image = Annotated[str, Field(min_length=1)]


class Function(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: Function


class CallFunction(RequestModel):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(RequestModel):
    """An earlier tool call; its arguments an object, as Ollama sends them."""

    function: CallFunction


class Message(RequestModel):
    """A turn; earlier ``thinking`` is left out, as thinking models'
    templates leave out earlier reasoning."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Image] | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


Think = bool | Literal["low", "medium", "high"]
Format = Literal["", "json"] | dict[str, Any]

# Top-level fields of Ollama's reference this server refuses whenever set.
_REFUSED = {
    "context": "this server keeps no conversation between requests; send the "
    "whole conversation to /api/chat",
    "width": "this server generates no images",
    "height": "this server generates no images",
    "steps": "this server generates no images",
    "debug_render_only": "this server renders no prompt without generating",
}


class GenerationBody(RequestBody):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model: str = Field(min_length=1)
    stream: bool | None = None  # None: streamed, Ollama's default
    format: Format | None = None
    options: Options = Field(default_factory=Options)
    keep_alive: KeepAlive = None
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    # Ollama's defaults (cut a long prompt, shift a full context) are what
    # this server cannot do: only false is accepted.
    truncate: bool | None = None
    shift: bool | None = None
    debug_render_only: Any = None
    width: Any = None
    height: Any = None
    steps: Any = None

    _refuse = refusing({key: _REFUSED[key] for key in _REFUSED if key != "context"})

    @field_validator("truncate", "shift")
    @classmethod
    def _check_false(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported_value(
                "truncate or shift",
                value,
                "this server neither cuts nor shifts a prompt longer than its "
                "limit, it refuses it; send false or leave it out",
            )
        return value


class ChatRequest(GenerationBody):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None

    @property
    def empty(self) -> bool:
        """No turn at all: a request to load (or unload) the model."""
        return not self.messages


class GenerateRequest(GenerationBody):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[Image] | None = None
    context: Any = None

    _refuse_context = refusing({"context": _REFUSED["context"]})

    @property
    def empty(self) -> bool:
        """No prompt: a request to load (or unload) the model."""
        return not self.prompt and not self.images and not self.suffix


def _no_sampling(value: Options) -> Options:
    asked = [name for name in HONOURED if getattr(value, name) is not None]
    if asked:
        raise unsupported(asked[0], "an embedding takes no sampling nor context option")
    return value


#: An embedding's ``options``: those without effect only.
EmbedOptions = Annotated[Options, AfterValidator(_no_sampling)]


class EmbedRequest(RequestBody):
    model: str = Field(min_length=1)
    input: str | Annotated[list[str], Field(max_length=2048)] = Field(
        default_factory=list
    )
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: KeepAlive = None
    options: EmbedOptions = Field(default_factory=Options)

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @property
    def empty(self) -> bool:
        """No input: a request to load (or unload) the model."""
        return not self.texts


class EmbeddingsRequest(RequestBody):
    """The older ``/api/embeddings``: one ``prompt``."""

    model: str = Field(min_length=1)
    prompt: str = ""
    keep_alive: KeepAlive = None
    options: EmbedOptions = Field(default_factory=Options)

    @property
    def empty(self) -> bool:
        return not self.prompt


class ShowRequest(RequestBody):
    model: str | None = None
    name: str | None = None  # the older spelling of model
    verbose: bool = False
    # The model's own, as the request does not change what a model is.
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None

    @property
    def named(self) -> str:
        return self.model or self.name or ""
