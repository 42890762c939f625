"""What the event loop and the MLX thread hand each other, as plain values.

A shared module: no Starlette, no pydantic, no MLX. The HTTP side turns a
request into :class:`GenerationParams` and the media references of
:mod:`.media` (decoded videos and audio travel in the params); the
engine, on the MLX thread, answers with one :class:`TokenEvent` per token
and one :class:`FinalEvent`, through an :class:`EventStream`. The HTTP side
knows the engine only through the :class:`Engine` protocol, so it never
imports MLX; ``app.py`` wires the real one in.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from .limits import check_prompt_tokens

if TYPE_CHECKING:
    from PIL import Image

    from .formats import ModelFormats
    from .media import Audio, AudioInput, Video


__all__ = [
    "ChatFacts",
    "Engine",
    "EngineCounters",
    "Event",
    "EventSource",
    "EventStream",
    "Facts",
    "FinalEvent",
    "FinishReason",
    "GenerationParams",
    "Grammar",
    "PromptLogprob",
    "Resident",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprobs",
]

#: Why a generation ended: an end of turn or a stop string, or ``max_tokens``.
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text, enforced token by token.

    The engine compiles it with llguidance against the model's tokenizer
    and masks, at every step, the tokens that cannot continue it; once the
    grammar is complete only the end of turn is allowed.

    Attributes:
        kind: ``json_schema`` (``source`` is a JSON schema, as text),
            ``json_object`` (any JSON object; ``source`` is ignored),
            ``regex`` (``source`` is a regular expression the whole text
            matches) or ``lark`` (``source`` is an llguidance Lark grammar,
            which may embed JSON schemas with ``%json {...}``).
        source: The grammar's text.
    """

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    source: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How one generation picks its tokens; built once from a request's
    fields and carried unchanged to the sampler.

    Attributes:
        temperature: Sampling temperature (0: greedy; None: the
            checkpoint's default).
        top_p: Nucleus sampling (None: the checkpoint's default).
        top_k: Sample from the ``top_k`` most likely tokens (0: no limit;
            None: the checkpoint's default).
        min_p: Drop tokens less likely than ``min_p`` times the most likely
            one (0: off).
        seed: Keys the draw at every position; same seed, same request, same
            output (None: one is drawn).
        presence_penalty: Subtracted from the logit of every token generated
            so far (OpenAI's definition, -2 to 2).
        frequency_penalty: Subtracted from a token's logit once per time it
            was generated so far (OpenAI's definition, -2 to 2).
        repetition_penalty: Divides the positive logits (and multiplies the
            negative ones) of every token of the prompt and of the answer so
            far (vLLM's and Hugging Face's definition; 1: off).
        logit_bias: ``(token id, bias)`` pairs added to the logits.
        logprobs: Whether each token's log-probability is returned.
        top_logprobs: How many alternatives to return per token.
        min_tokens: No end of turn nor stop token before this many tokens
            (vLLM's: their logits are -inf until then, and stop strings
            are not looked for).
        ignore_eos: The model's ends of turn do not end the generation
            (vLLM's: it runs to ``max_tokens``, a stop string or a stop
            token).
        stop_token_ids: Token ids that end the generation, as an end of
            turn does (vLLM's).
        allowed_token_ids: Only these tokens may be sampled (vLLM's; empty:
            every token).
        bad_words: Words that are never generated (vLLM's): a word's last
            token is barred where the tokens before it were just generated
            (its first, always, for a one-token word).
        eos_token_ids: The model's end-of-turn tokens; filled in at
            admission, never by a request.
        prompt_logprobs: The prompt's log-probabilities are computed in its
            prefill, with this many alternatives per token (vLLM's
            ``prompt_logprobs``; None: not computed). A prompt that asks
            for them is prefilled whole, never from the prompt cache.
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
        """Whether ``token`` ends the generation (resolved: see
        ``eos_token_ids``)."""
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

    Attributes:
        messages: The chat as mlx-vlm's chat messages: ``{"role", "content"}``
            dicts whose content is a string or a list of ``{"type": "text",
            "text"}``, ``{"type": "image_url"}`` and ``{"type": "video"}``
            parts. Unused when ``prompt`` is set.
        max_tokens: Most tokens to generate.
        sampling: How its tokens are picked.
        stop: Stop strings; generation ends before them.
        include_stop_str_in_output: The text ends with the stop string, or
            the stop token's text, that ended it (vLLM's).
        skip_special_tokens: Special tokens are left out of the text
            (vLLM's; False: their text is in it, as mlx-vlm gives it).
        return_tokens_as_token_ids: Log-probabilities name each token
            ``token_id:N``, not by its text (vLLM's).
        max_prompt_tokens: Refuse a longer prompt (None: no limit of its own).
        context_length: Refuse a prompt that, with ``max_tokens``, is longer
            (None: the model has no known context length).
        grammar: The constraint the text must follow (None: free text).
        tools: Tool definitions (OpenAI's ``tools`` entries, as dicts) for
            the chat template.
        template_kwargs: Extra keyword arguments for the chat template
            (``chat_template_kwargs``, e.g. ``enable_thinking``).
        prompt: A raw prompt instead of ``messages``: text, tokenized without
            the chat template, or token ids, used as they are (None: the
            chat template renders ``messages``).
        add_special_tokens: Whether the tokenizer adds its special tokens
            (a BOS) to a text ``prompt``.
        truncate_prompt_tokens: Keep the prompt's last N tokens (vLLM's;
            -1: the model's context length; None: the whole prompt).
        videos: The decoded videos of ``messages``, in prompt order (the
            HTTP side decodes them off the event loop and sets them).
        audios: The decoded audio files of ``messages`` (its ``input_audio``
            parts), in prompt order, at the model's sample rate (set as
            ``videos`` are).
        thinking_budget: Most reasoning tokens before the closing marker is
            forced (None: no budget); applied where ``thinking_markers`` is
            set and the text is not constrained.
        priority: Its place at the model's gate: the lowest waiting is
            admitted first, in arrival order within one (vLLM's).
        thinking_markers: The model's reasoning markers as text,
            ``(opening, closing)``; the opening is empty when the chat
            template opens the reasoning itself (the HTTP side reads both
            from the model's reasoning format; the engine tokenizes them).
        prediction: The answer's expected text (OpenAI's predicted
            outputs): its tokens are the row's speculative drafts; the
            answer is the same with it or without (empty: none).
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

    def check_prompt_tokens(self, prompt_tokens: int) -> None:
        """Refuse a prompt over this request's limits; call before prefill.

        Raises:
            PromptTooLongError: The message gives the numbers.
        """
        check_prompt_tokens(
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

    Attributes:
        token_id: The token.
        token: Its text, as log-probabilities show it.
        bytes: Its UTF-8 bytes.
        logprob: Its log-probability (raw: the model's distribution); None
            for the prompt's first token, which nothing comes before.
        rank: Its rank in that distribution (1: the most likely); None
            with ``logprob``.
        top: The most likely tokens there, likeliest first: id, text,
            log-probability.
    """

    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None
    rank: int | None
    top: tuple[tuple[int, str, float], ...]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token.

    Attributes:
        text: Text released with this token; may be empty while the
            detokenizer waits for more bytes or text could start a stop string.
        logprobs: The token's log-probabilities, when requested.
    """

    text: str
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class FinalEvent:
    """The end of a generation.

    Attributes:
        text: Text still held back, released now.
        finish_reason: ``stop`` (end of turn or a stop string) or ``length``.
        prompt_tokens: Tokens in the prompt, image tokens included.
        completion_tokens: Tokens generated (the end-of-turn token excluded).
        prefill_seconds: Time to the first token on the MLX thread.
        decode_seconds: Time from the first token to the end.
        cached_tokens: Prompt tokens taken from the prompt cache, not
            prefilled (OpenAI's ``usage.prompt_tokens_details``); the
            answer is the same either way, so events compare equal.
        stop_reason: What ended a ``stop`` (vLLM's ``stop_reason``): the
            stop string, or the stop token's id (``stop_token_ids``); None
            for an end of turn and for ``length``.
        prompt_logprobs: The prompt's tokens with their log-probabilities
            (the first's None: nothing comes before it), when asked for
            (``SamplingParams.prompt_logprobs``); empty otherwise.
        accepted_prediction_tokens: Tokens of the request's prediction the
            answer kept (drafts verified and kept).
        rejected_prediction_tokens: Tokens of its prediction verified and
            not kept.
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
        """The stop string that ended the generation (None: it ended
        otherwise)."""
        return self.stop_reason if isinstance(self.stop_reason, str) else None


Event = TokenEvent | FinalEvent


class EventSource(Protocol):
    """What an :class:`EventStream` reads (the engine's per-row stream, which
    also has ``flowing`` and takes ``batched(None)``; an ``MLXThread.iterate``
    stream of events fits too)."""

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
        every event in one tuple, once the generation ended (an answer sent
        whole: one wake-up). A source that cannot (an ``MLXThread.iterate``
        stream) gathers them one at a time. :meth:`aclose` still closes the
        generation."""
        if n is None and not hasattr(self._inner, "flowing"):
            return self._whole()
        return self._inner.batched(n)

    async def _whole(self) -> AsyncGenerator[tuple[Event, ...], None]:
        events = tuple([event async for event in self])
        if events:
            yield events

    def flowing(self, interval: float) -> AsyncGenerator[tuple[Event, ...], None]:
        """The events as they come: at each wake-up every one that is in,
        and at most one wake-up each ``interval`` seconds but the first
        (a streamed answer's writes: fewer,
        larger ones when tokens come faster than that). A source that cannot
        (an ``MLXThread.iterate`` stream) gives one event a wake-up."""
        flowing = getattr(self._inner, "flowing", None)
        if flowing is None:
            return self._each()
        events: AsyncGenerator[tuple[Event, ...], None] = flowing(interval)
        return events

    async def _each(self) -> AsyncGenerator[tuple[Event, ...], None]:
        async for event in self:
            yield (event,)

    async def aclose(self) -> None:
        """Take the generation out, and wait until it is out."""
        await self._inner.aclose()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@dataclass(frozen=True)
class EngineCounters:
    """What the engine reports to metrics and ``/health``; plain numbers.

    Attributes:
        rows: Generations in the batch, joining it or being prefilled.
        kv_bytes: Bytes of KV cache held by those rows.
        prompt_cache_hits: Requests that reused cached prompt KV.
        prompt_cache_misses: Requests that looked and found none.
        prompt_cache_reused_tokens: Prompt tokens not prefilled thanks to it.
        prompt_cache_bytes: Bytes of KV the prompt cache holds.
        ranks: Under tensor parallelism, the rows each rank holds, rank 0
            first (the others as of their last message); empty otherwise.
        kv_bytes_per_token: Bytes of KV cache one token takes (every layer;
            quantized under ``kv_bits``); 0 before the first generation.
        decode_steps: Decode steps run (speculative ones included).
        decoded_tokens: Tokens those steps gave.
        speculative_steps: Decode steps that verified drafts.
        speculative_rows: Their rows, summed over those steps.
        draft_tokens: Draft tokens verified.
        accepted_tokens: Draft tokens kept.
        image_cache_bytes: Bytes of vision-tower outputs the image cache
            holds.
        disk_cache_bytes: Bytes of files the two caches' disk tier holds
            (``--state-dir``).
        mlx_memory: MLX's memory, the whole process's (every model's):
            ``(active, cached, peak)`` bytes, as ``mx.get_active_memory``,
            ``mx.get_cache_memory`` and ``mx.get_peak_memory`` give them.
    """

    rows: int
    kv_bytes: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    prompt_cache_reused_tokens: int
    prompt_cache_bytes: int
    ranks: tuple[int, ...] = ()
    kv_bytes_per_token: int = 0
    # Speculative decoding (engine/drafting.py), and the steps it shortens.
    decode_steps: int = 0
    decoded_tokens: int = 0
    speculative_steps: int = 0
    speculative_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    image_cache_bytes: int = 0
    disk_cache_bytes: int = 0
    mlx_memory: tuple[int, int, int] = (0, 0, 0)


class Facts(Protocol):
    """What a loaded model of any kind is: one frozen value its engine
    builds at load (each kind has its own), read by the doors and the
    registry."""

    def card(self) -> dict[str, Any]:
        """Its entries in its ``/v1/models`` card."""
        ...


@runtime_checkable
class Resident(Protocol):
    """A loaded model of any kind, as the model registry sees it."""

    @property
    def facts(self) -> Facts:
        """What the model is."""
        ...

    @property
    def loaded_at(self) -> float:
        """When the load ended (Unix time)."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (what the memory budget counts)."""
        ...

    def counters(self) -> EngineCounters:
        """A snapshot for metrics; any thread (it may be a step old)."""
        ...


@dataclass(frozen=True, slots=True)
class ChatFacts:
    """What a loaded chat model is, built once by its engine at load.

    Attributes:
        context_length: Its context in tokens (None: unknown).
        vocab_size: Valid token ids are below it.
        longest_token_chars: Characters in its longest token, which bounds
            the tokens a text is at least.
        accepts_images: Whether it takes images (and videos).
        chat_template: Its chat template (None: it has none).
        formats: Its tool-call and reasoning formats, set for it or detected
            from its template.
        audio_input: How it takes audio (None: it takes none).
    """

    context_length: int | None
    vocab_size: int
    longest_token_chars: int
    accepts_images: bool
    chat_template: str | None
    formats: ModelFormats
    audio_input: AudioInput | None = None

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
    def facts(self) -> ChatFacts:
        """What the model is."""
        ...

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> EventStream:
        """Start a generation; its events."""
        ...

    async def tokenize(self, params: GenerationParams) -> tuple[tuple[int, str], ...]:
        """The prompt's tokens as a generation of ``params`` would prefill
        them (text only), each id with its text as log-probabilities show it."""
        ...

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (each below the vocabulary size)."""
        ...

    async def count_tokens(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> int:
        """The tokens of the prompt of ``params``, images included, as its
        prefill would count them; nothing is generated."""
        ...
