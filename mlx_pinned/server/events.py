"""What the event loop and the MLX thread hand each other, as plain values.

A shared module (no Starlette, pydantic or MLX): the HTTP side builds
:class:`GenerationParams`; the engine, on the MLX thread, answers through an
:class:`EventStream` of :class:`TokenEvent` and one :class:`FinalEvent`. The
HTTP side knows a chat engine only through the :class:`Engine` protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from .limits import max_tokens_for
from .resident import Resident

if TYPE_CHECKING:
    from PIL import Image

    from .formats import ModelFormats
    from .media import Audio, AudioInput, Video


__all__ = [
    "ChatFacts",
    "Engine",
    "Event",
    "EventSource",
    "EventStream",
    "FinalEvent",
    "FinishReason",
    "GenerationParams",
    "Grammar",
    "PromptLogprob",
    "PromptProgress",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprobs",
]

#: Why a generation ended: an end of turn or a stop string, or ``max_tokens``.
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text, enforced token by token with
    llguidance; once it is complete only the end of turn is allowed.

    ``source`` is, by ``kind``: a JSON schema (``json_schema``), ignored
    (``json_object``: any JSON object), a regular expression the whole text
    matches (``regex``), or an llguidance Lark grammar, which may embed JSON
    schemas with ``%json {...}`` (``lark``).
    """

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    source: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How one generation picks its tokens, carried unchanged to the sampler.

    The fields mean what OpenAI's and vLLM's of the same name do; None for
    ``temperature``, ``top_p`` and ``top_k`` is the checkpoint's default.

    Attributes:
        seed: Keys the draw at every position; same seed, same request, same
            output (None: one is drawn).
        repetition_penalty: Divides the positive logits (and multiplies the
            negative ones) of every token of the prompt and of the answer so
            far (vLLM's and Hugging Face's definition; 1: off).
        min_tokens: No end of turn nor stop token before this many tokens;
            stop strings are not looked for until then.
        bad_words: A word's last token is barred where the tokens before it
            were just generated (its first, always, for a one-token word).
        eos_token_ids: The model's end-of-turn tokens; filled in at
            admission, never by a request.
        prompt_logprobs: Alternatives per prompt token (None: not computed).
            A prompt that asks for them is prefilled whole, never from the
            prompt cache.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None

    def ends(self, token: int) -> bool:
        if token in self.stop_token_ids:
            return True
        return not self.ignore_eos and token in self.eos_token_ids

    def stop_token(self, token: int) -> int | None:
        """``token`` where it ends the generation as a stop token, not as an
        end of turn (vLLM's ``stop_reason``: an end of turn comes first,
        unless ``ignore_eos``); None otherwise."""
        if not self.ignore_eos and token in self.eos_token_ids:
            return None
        return token if token in self.stop_token_ids else None

    @property
    def held_token_ids(self) -> tuple[int, ...]:
        """The tokens kept off until ``min_tokens``: every end of turn and
        stop token, as vLLM keeps them off (under ``ignore_eos`` too)."""
        return (*self.eos_token_ids, *self.stop_token_ids)

    @property
    def penalized(self) -> bool:
        """Whether any penalty reads the tokens so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class GenerationParams:
    """What one generation needs from a request; plain values, built anywhere.

    Fields named as vLLM's or OpenAI's mean what theirs do.

    Attributes:
        messages: mlx-vlm's chat messages, whose content is a string or a
            list of ``text``, ``image_url`` and ``video`` parts. Unused when
            ``prompt`` is set.
        skip_special_tokens: False: their text is in the answer, as mlx-vlm
            gives it.
        max_prompt_tokens: Refuse a longer prompt (None: no limit of its own).
        context_length: The model's; generation stops where it is full
            (None: the model has no known context length).
        template_kwargs: ``chat_template_kwargs`` (e.g. ``enable_thinking``).
        prompt: Text, tokenized without the chat template, or token ids, used
            as they are (None: the chat template renders ``messages``).
        truncate_prompt_tokens: Keep the prompt's last N tokens (-1: the
            model's context length; None: the whole prompt).
        videos: The decoded videos of ``messages``, in prompt order (decoded
            off the event loop).
        audios: Its decoded ``input_audio`` parts, in prompt order, at the
            model's sample rate.
        thinking_budget: Most reasoning tokens before the closing marker is
            forced (None: no budget); applied where ``thinking_markers`` is
            set and the text is not constrained.
        priority: The lowest waiting is admitted first, in arrival order
            within one.
        thinking_markers: ``(opening, closing)`` as text; the opening is
            empty when the chat template opens the reasoning itself.
        prediction: The answer's expected text, its tokens the row's
            speculative drafts; the answer is the same without it.
    """

    messages: tuple[dict[str, Any], ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = False
    return_tokens_as_token_ids: bool = False
    max_prompt_tokens: int | None = None
    context_length: int | None = None
    grammar: Grammar | None = None
    tools: tuple[dict[str, Any], ...] = ()
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    prompt: str | tuple[int, ...] | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    videos: tuple[Video, ...] = ()
    audios: tuple[Audio, ...] = ()
    thinking_budget: int | None = None
    thinking_markers: tuple[str, str] | None = None
    priority: int = 0
    prediction: str = ""

    def max_tokens_for(self, prompt_tokens: int) -> int:
        """``max_tokens``, cut to what the context leaves after a prompt of
        ``prompt_tokens`` (:func:`~.limits.max_tokens_for`).

        Raises:
            PromptTooLongError: A prompt over this request's limits.
        """
        return max_tokens_for(
            prompt_tokens,
            self.max_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            context=self.context_length,
        )


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability and its top alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it.

    ``logprob`` (the model's raw distribution) and ``rank`` (1: the most
    likely) are None for the prompt's first token; ``top`` holds the likeliest
    tokens there (id, text, log-probability), likeliest first.
    """

    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None
    rank: int | None
    top: tuple[tuple[int, str, float], ...]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token; ``text`` may be empty while the detokenizer waits
    for more bytes or the text could start a stop string."""

    text: str
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class FinalEvent:
    """The end of a generation, with the text still held back.

    Attributes:
        prompt_tokens: Image tokens included.
        completion_tokens: The end-of-turn token excluded.
        prefill_seconds: Time to the first token on the MLX thread.
        cached_tokens: Prompt tokens taken from the prompt cache; the answer
            is the same either way, so events compare equal.
        stop_reason: What ended a ``stop`` (vLLM's): the stop string, or the
            stop token's id; None for an end of turn and for ``length``.
        accepted_prediction_tokens: Tokens of the request's prediction
            verified and kept (``rejected_...``: verified and not kept).
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float = field(default=0.0, compare=False)
    decode_seconds: float = field(default=0.0, compare=False)
    cached_tokens: int = field(default=0, compare=False)
    stop_reason: int | str | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] = field(default=(), compare=False)
    accepted_prediction_tokens: int = field(default=0, compare=False)
    rejected_prediction_tokens: int = field(default=0, compare=False)

    @property
    def stop_sequence(self) -> str | None:
        return self.stop_reason if isinstance(self.stop_reason, str) else None


Event = TokenEvent | FinalEvent


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """Where a prompt's prefill stands, as llama.cpp's ``prompt_progress``
    says it: of its ``total`` tokens (images included), ``cached`` came from
    the prompt cache and ``processed`` (those included) are in its KV,
    ``seconds`` after the engine took it. Not an :data:`Event`: a stream
    hands them out apart (:meth:`EventStream.accepted`)."""

    total: int
    cached: int
    processed: int
    seconds: float


class EventSource(Protocol):
    """What an :class:`EventStream` reads: the engine's per-row stream (which
    also has ``flowing``) or an ``MLXThread.iterate`` stream of events."""

    def __anext__(self) -> Awaitable[Event]: ...

    def batched(self, n: int | None) -> AsyncIterator[tuple[Event, ...]]: ...

    def aclose(self) -> Awaitable[None]: ...


class EventStream:
    """The events of one generation, on the event loop.

    Iterating gives every :class:`TokenEvent`, then one :class:`FinalEvent`
    (or raises the generation's error); :meth:`aclose` (or cancelling the
    consumer) takes the generation out of the batch.
    """

    def __init__(self, inner: EventSource) -> None:
        self._inner = inner

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        return await self._inner.__anext__()

    def batched(self, n: int | None) -> AsyncIterator[tuple[Event, ...]]:
        """The events in tuples of up to ``n``, one wake-up per tuple; None:
        every event in one tuple, once the generation ended. A source that
        cannot (an ``MLXThread.iterate`` stream) gathers them one at a time."""
        if n is None and not hasattr(self._inner, "flowing"):
            return self._whole()
        return self._inner.batched(n)

    async def _whole(self) -> AsyncGenerator[tuple[Event, ...], None]:
        events = tuple([event async for event in self])
        if events:
            yield events

    def flowing(self, interval: float) -> AsyncGenerator[tuple[Event, ...], None]:
        """The events as they come: at each wake-up every one that is in, and
        at most one wake-up each ``interval`` seconds, the first excepted. A
        source that cannot (an ``MLXThread.iterate`` stream) gives one event
        a wake-up."""
        flowing = getattr(self._inner, "flowing", None)
        if flowing is None:
            return self._each()
        events: AsyncGenerator[tuple[Event, ...], None] = flowing(interval)
        return events

    async def _each(self) -> AsyncGenerator[tuple[Event, ...], None]:
        async for event in self:
            yield (event,)

    async def accepted(self) -> PromptProgress | None:
        """Wait until the engine took the generation (its prompt built and
        checked) and give its first progress; None where it refused it (the
        events raise why) or its source reports no progress."""
        accepted = getattr(self._inner, "accepted", None)
        return None if accepted is None else await accepted()

    def prefill(self) -> AsyncGenerator[PromptProgress, None]:
        """Each new progress of the prompt's prefill, until its first event
        (a token, the end or an error) is in; none from a source that
        reports none."""
        prefill = getattr(self._inner, "prefill", None)
        return _nothing() if prefill is None else prefill()

    async def aclose(self) -> None:
        """Take the generation out, and wait until it is out."""
        await self._inner.aclose()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _nothing() -> AsyncGenerator[PromptProgress, None]:
    return
    yield


@dataclass(frozen=True, slots=True)
class ChatFacts:
    """What a loaded chat model is, built once by its engine at load.

    Attributes:
        context_length: In tokens (None: unknown).
        longest_token_chars: Characters in its longest token, which bounds
            from below the tokens a text takes.
        accepts_images: Images and videos.
        formats: Set for the model or detected from its template.
        kv_bytes_per_token: A token's KV in its batch, every layer, quantized
            under ``kv_bits`` (0: not known before its first rows).
    """

    context_length: int | None
    vocab_size: int
    longest_token_chars: int
    accepts_images: bool
    chat_template: str | None
    formats: ModelFormats
    audio_input: AudioInput | None = None
    kv_bytes_per_token: int = 0

    def card(self) -> dict[str, Any]:
        """Its entries in ``/v1/models``: its formats by name, and what its
        messages may hold (OpenRouter's ``input_modalities``)."""
        taken = {"image": self.accepts_images, "audio": self.audio_input is not None}
        modalities = ["text", *(kind for kind, takes in taken.items() if takes)]
        return {"formats": self.formats.names(), "input_modalities": modalities}


@runtime_checkable
class Engine(Resident, Protocol):
    """A loaded chat model as the HTTP side sees it (``app.py`` wires the
    real one, :class:`mlx_pinned.server.engine.BatchEngine`). Each method is
    called on the event loop; its work runs on the MLX thread."""

    @property
    def facts(self) -> ChatFacts: ...

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> EventStream: ...

    async def tokenize(self, params: GenerationParams) -> tuple[tuple[int, str], ...]:
        """The prompt's tokens as a generation of ``params`` would prefill
        them (text only), each id with its text as log-probabilities show it."""
        ...

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (each below the vocabulary size)."""
        ...

    async def lend_cache(self, nbytes: int) -> None:
        """Keep its prompt cache ``nbytes`` under its budget, for the
        requests' charges (its oldest entries past that dropped now)."""
        ...

    async def count_tokens(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> int:
        """The tokens of the prompt of ``params``, images included, as its
        prefill would count them; nothing is generated."""
        ...
