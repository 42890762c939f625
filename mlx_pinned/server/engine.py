"""The model-facing side of the server: everything here runs on the MLX thread.

:func:`load` loads a model with mlx-vlm and evaluates it whole, so nothing lazy
is left to tie it to a stream. :func:`generate_stream` is a sync generator over
``mlx_vlm.stream_generate`` that the app runs with ``MLXThread.iterate``: one
:class:`TokenEvent` per generated token, then one :class:`FinalEvent`. Events
hold plain Python values only; no MLX array leaves the thread.

One generation at a time per model: mlx-vlm's Qwen-VL models keep request
state on the model object, so two interleaved generations corrupt each other.
The app serialises them (see ``app.py``); :func:`generate_stream` also closes a
stale generation it finds still open on the model before it starts.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ._limits import check_prompt_tokens, context_length, longest_token_chars
from ._prompt import build_prompt as build_prompt
from ._prompt import chat_messages as chat_messages
from ._prompt import prepare_inputs
from ._text import StopMatcher as StopMatcher
from ._text import TextDecoder, token_bytes
from .schemas import ChatCompletionRequest

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "FinalEvent",
    "GenerationParams",
    "LoadedModel",
    "StopMatcher",
    "TokenEvent",
    "TokenLogprobs",
    "build_prompt",
    "chat_messages",
    "generate_stream",
    "load",
]

logger = logging.getLogger("mlx_pinned.server")
_TOP_P_FLOOR = 1.1754943508222875e-38  # float32's smallest normal number


@dataclass(eq=False)
class LoadedModel:
    """A model, its processor and config, loaded and evaluated on the MLX thread.

    Attributes:
        model: The mlx-vlm model.
        processor: Its processor (tokenizer, image processor, detokenizer).
        path: What it was loaded from (a folder or a hub id).
        load_seconds: How long :func:`load` took.
        parameters: Number of parameters.
        loaded_at: When the load ended (Unix time): ``created`` in
            ``/v1/models``.
    """

    model: Any
    processor: Any
    path: str
    load_seconds: float
    parameters: int
    loaded_at: float = field(default_factory=time.time)  # Unix time, at the end
    _token_text: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    _active: Any = None  # the open stream_generate generator, if any
    _longest_token: int | None = None

    @property
    def config(self) -> Any:
        """The model's config object."""
        return self.model.config

    @property
    def context_length(self) -> int | None:
        """The model's context length in tokens, from its config (or None)."""
        return context_length(self.config)

    @property
    def longest_token_chars(self) -> int:
        """Characters in the longest token of the vocabulary (computed once)."""
        if self._longest_token is None:
            self._longest_token = longest_token_chars(self.tokenizer)
        return self._longest_token

    @property
    def tokenizer(self) -> Any:
        """The text tokenizer."""
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output: valid token ids are below it."""
        config = self.config
        text_config = getattr(config, "text_config", None)
        size = getattr(text_config, "vocab_size", None) or getattr(
            config, "vocab_size", None
        )
        return int(size) if size else len(self.tokenizer)

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and UTF-8 bytes, as OpenAI's logprobs show them.

        A byte-level BPE token can hold part of a character: its bytes are
        exact and its text shows the partial bytes as ``\\xNN``.
        """
        cached = self._token_text.get(token_id)
        if cached is None:
            raw = token_bytes(self.processor, self.tokenizer, token_id)
            cached = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
            self._token_text[token_id] = cached
        return cached


def load(model_path: str | Path) -> LoadedModel:
    """Load a model with mlx-vlm and evaluate all of it.

    Runs on the MLX thread (the middleware's start-up job): the weights, and
    lazily built arrays such as RoPE tables, are evaluated here so no lazy
    array remains tied to another thread's stream.

    Args:
        model_path: A local folder or a Hugging Face hub id.

    Raises:
        Whatever mlx-vlm raises for a missing or unsupported model.
    """
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load as vlm_load

    start = time.perf_counter()
    logger.info("loading model %s", model_path)
    model, processor = vlm_load(str(model_path))
    mx.eval(model)  # the whole tree, private attributes included
    seconds = time.perf_counter() - start
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    parameters = sum(v.size for _, v in flat)
    loaded = LoadedModel(model, processor, str(model_path), seconds, parameters)
    _ = loaded.longest_token_chars  # once, at load, not in a request
    logger.info(
        "loaded %s (%s, %d parameters) in %.2f s",
        model_path,
        getattr(model.config, "model_type", "?"),
        parameters,
        seconds,
    )
    return loaded


@dataclass(frozen=True)
class GenerationParams:
    """What one generation needs from a request; plain values, built anywhere.

    Attributes:
        messages: The chat in mlx-vlm's message format (see :func:`chat_messages`).
        max_tokens: Most tokens to generate.
        temperature: Sampling temperature; None uses the checkpoint's default.
        top_p: Nucleus sampling; None uses the checkpoint's default.
        seed: Seed for sampling; same seed, same request, same output.
        stop: Stop strings; generation ends before them.
        logprobs: Whether to return each token's log-probability.
        top_logprobs: How many alternatives to return per token.
        logit_bias: ``(token id, bias)`` pairs added to the logits.
        max_prompt_tokens: Refuse a longer prompt (None: no limit of its own).
        context_length: Refuse a prompt that, with ``max_tokens``, is longer
            (None: the model has no known context length).
    """

    messages: tuple[dict[str, Any], ...]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    max_prompt_tokens: int | None = None
    context_length: int | None = None

    @classmethod
    def from_request(
        cls,
        request: ChatCompletionRequest,
        max_tokens: int,
        *,
        max_prompt_tokens: int | None = None,
        context_length: int | None = None,
    ) -> GenerationParams:
        """The parameters of a validated request, with ``max_tokens`` resolved."""
        return cls(
            messages=tuple(chat_messages(request.messages)),
            max_tokens=max_tokens,
            temperature=request.temperature,
            # At least float32's smallest normal number: a smaller top_p
            # became 0 in float32 and no token was ever kept (an empty
            # answer); this one keeps the most likely token, as 1e-30 does.
            top_p=None if request.top_p is None else max(request.top_p, _TOP_P_FLOOR),
            seed=request.seed,
            stop=request.stop_sequences,
            logprobs=bool(request.logprobs),
            top_logprobs=request.top_logprobs or 0,
            logit_bias=tuple(request.token_bias.items()),
            max_prompt_tokens=max_prompt_tokens,
            context_length=context_length,
        )

    def check_prompt_tokens(self, prompt_tokens: int) -> None:
        """Refuse a prompt over this request's limits; call before prefill.

        Raises:
            PromptTooLongError: A 400 whose message gives the numbers.
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
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float = field(default=0.0, compare=False)
    decode_seconds: float = field(default=0.0, compare=False)


Event = TokenEvent | FinalEvent


def generate_stream(
    loaded: LoadedModel,
    params: GenerationParams,
    images: Sequence[Image.Image] = (),
) -> Generator[Event, None, None]:
    """Generate a chat completion token by token.

    A sync generator to run on the MLX thread (``MLXThread.iterate``): the
    prompt, the image preprocessing and every step run where it is advanced.
    Closing it (the client left) closes mlx-vlm's generator at once.

    Args:
        loaded: The model, from :func:`load`.
        params: The request's parameters.
        images: The decoded images, in prompt order.

    Yields:
        A :class:`TokenEvent` per generated token, then one :class:`FinalEvent`.

    Raises:
        PromptTooLongError: The prompt is over a limit of ``params``; raised
            before any prefill.
    """
    start = time.perf_counter()
    stale = loaded._active
    if stale is not None:
        # Its consumer is gone (the app runs one at a time): close it before
        # this generation overwrites the model's request state. Its failure
        # to close is not this request's.
        logger.warning("closing a generation left open on %s", loaded.path)
        loaded._active = None
        try:
            stale.close()
        except Exception:
            logger.exception("closing the generation left open failed")
    if params.seed is not None:
        mx.random.seed(params.seed % 2**64)  # per thread: this is the MLX thread
    prompt = build_prompt(loaded, params.messages)
    kwargs: dict[str, Any] = {"max_tokens": params.max_tokens}
    for name in ("temperature", "top_p", "seed"):
        if getattr(params, name) is not None:
            kwargs[name] = getattr(params, name)
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    inputs = prepare_inputs(loaded, prompt, images)
    params.check_prompt_tokens(int(inputs["input_ids"].shape[-1]))
    stream_generate = importlib.import_module("mlx_vlm.generate").stream_generate
    inner = stream_generate(loaded.model, loaded.processor, prompt, **inputs, **kwargs)
    loaded._active = inner
    matcher = StopMatcher(params.stop)
    decoder = TextDecoder(loaded.processor, lambda t: loaded.token_text(t)[1])
    finish, tail = "length", ""
    prompt_tokens = completion = 0
    first_token_at: float | None = None
    try:
        for result in inner:
            prompt_tokens = result.prompt_tokens
            if result.finish_reason is not None:  # the last result holds no new token
                text, stopped = matcher.feed(decoder.finish(result.text))
                finish, tail = ("stop" if stopped else result.finish_reason), text
                break
            text, stopped = matcher.feed(decoder.add(result.token, result.text))
            completion += 1
            if first_token_at is None:
                first_token_at = time.perf_counter()
            logprobs = None
            if params.logprobs:
                logprobs = _logprobs(loaded, result.token, result.logprobs, params)
            yield TokenEvent(text, logprobs)
            if stopped:
                finish = "stop"
                break
    finally:
        inner.close()
        if loaded._active is inner:
            loaded._active = None
    tail += matcher.flush()  # held back as a possible stop string: it was not
    end = time.perf_counter()
    first = first_token_at or end
    yield FinalEvent(
        text=tail,
        finish_reason="stop" if finish == "stop" else "length",
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        prefill_seconds=first - start,
        decode_seconds=end - first,
    )


def _logprobs(
    loaded: LoadedModel, token: int, logprobs: mx.array, params: GenerationParams
) -> TokenLogprobs:
    chosen = logprobs[token]
    k = min(params.top_logprobs, logprobs.shape[-1])
    if k:
        indices = mx.argpartition(-logprobs, kth=k - 1)[:k]
        values = logprobs[indices]
        mx.eval(chosen, indices, values)
        ids = cast("list[int]", indices.tolist())
        scores = cast("list[float]", values.tolist())
        pairs = sorted(zip(ids, scores, strict=True), key=lambda p: -p[1])
    else:
        mx.eval(chosen)
        pairs = []
    text, raw = loaded.token_text(token)
    top = []
    for index, value in pairs:
        alt_text, alt_raw = loaded.token_text(index)
        top.append((alt_text, value, alt_raw))
    return TokenLogprobs(text, cast("float", chosen.item()), raw, top)
