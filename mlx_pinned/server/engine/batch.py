"""The engine: continuous batching of one model on the MLX thread.

Every request is a sync generator run on the MLX thread with
``MLXThread.iterate``: one :class:`~..events.TokenEvent` per token, then one
:class:`~..events.FinalEvent`. What they share is the model's
:class:`BatchEngine`, touched only on that thread, so it holds no locks. With
``max_num_seqs`` 1 the batch has one row: there is no other engine. A
request's generator:

- first turn: preprocesses its request (chat template, processor) and queues
  it. Through :meth:`BatchEngine.stream` it then yields a marker that the
  event loop side drops and gives the thread to the next request, so
  requests that arrive together are queued together;
  :meth:`BatchEngine.generate_stream` goes straight on;
- when it has no token: runs one step of the batch. A step collects the
  decode step in flight (one forward pass for every active sequence, one
  token each), prefills the queued prompts (up to 8 in one pass: their
  images through the vision tower together, their tokens left-padded into
  one cache; each one's first token is sampled from that pass's logits), lets
  them join, and starts the next decode step, built on this step's tokens
  before they are read (as mlx-vlm's own loop does), so it computes while the
  thread hands out tokens;
- when it has a token: yields it, cheaply; with N sequences about one turn
  in N runs a step;
- when it ends or is closed (client gone, ``aclose``, cancel, garbage
  collection): its ``finally`` takes the sequence out; its KV cache rows are
  dropped at the next step, or at once if it was the last.

``iterate`` streams take turns round-robin, so a step is one job: other jobs
and new requests get the thread between steps, and a slow client never holds
up the others (its tokens wait in its own buffer). The HTTP side's gate
bounds the active sequences (``max_num_seqs``); the rest wait on the event
loop, in arrival order, in a bounded room, using no MLX thread time.

Isolation: mlx-vlm's Qwen-VL language models keep request state on the model
object (``_rope_deltas``, ``_position_ids``). Here each sequence's rope delta
is captured at its prefill and every decode step passes all rows' deltas
(``rope_deltas=(B, 1)``) with per-row cache offsets, as mlx-vlm's own batch
decoding does, so no row reads another's state. Sampling is per row:
temperature, top_p, top_k, min_p, logit_bias, penalties, a grammar
(:mod:`.logits`), stop strings, max_tokens, logprobs;
a seeded row uses mlx-vlm's position-keyed sampler (a key per seed and
position), so a seed gives the same tokens alone, batched, or through
``mlx_vlm.stream_generate``.

Why not mlx-vlm's ``BatchGenerator`` (``mlx_vlm/generate/ar.py``, 0.7.10):
it is one driver loop that owns the batch (here each request's generator
must be able to advance it), with one sampler and one set of stop tokens for
the whole batch (the requests here each bring their own temperature, top_p,
seed and logit_bias), and it mutates the tokenizer's shared stopping
criteria. Its sound pieces are used: per-row ``rope_deltas`` with per-row
cache offsets, ``BatchKVCache`` merge / extend / filter, left-padded batched
prefill, and the position-keyed sampler.

Numbers: padded cache positions are masked and add exact zeros, matmul rows
are independent, so on the CPU backend every sequence's log-probabilities
are bit-identical to its run alone, and to ``mlx_vlm.stream_generate`` (the
tests allow 1e-5 for backends whose reductions may run in another order;
cross-talk moves them by 0.1-1). Do not run ``mlx_vlm.stream_generate`` on a
model while its engine has rows: it keeps its rope state on the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..events import (
    HANDOFF,
    EngineCounters,
    Event,
    EventStream,
    FinalEvent,
    FinishReason,
    GenerationParams,
    Handoff,
    TokenEvent,
    TokenLogprobs,
)
from .image_cache import install as install_image_cache
from .model import LoadedModel, load
from .prefill import PREFILL_STEP
from .prompt_cache import PromptCache
from .quirks import SequenceText
from .rows import BatchStatistics
from .sampling import Sampled
from .state import BatchState
from .text import StopMatcher

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread

__all__ = ["BatchEngine", "BatchStatistics"]

logger = logging.getLogger("mlx_pinned.server")


class BatchEngine:
    """Continuous batching for one loaded model: the server's engine.

    One per model. Its generators and its batch run on the MLX thread only;
    :meth:`stream` may be called from any thread, :meth:`statistics` read
    from any thread. It is the :class:`~..events.Engine` the HTTP side uses.

    Args:
        loaded: The model, from :func:`.model.load`.
        thread: The MLX thread the model was loaded on.
        prompt_cache_bytes: Bytes of prompt KV kept for later requests that
            start the same way (:mod:`.prompt_cache`); 0: none.
        prefill_step_size: Prompt tokens prefilled in one pass, at most.
        image_cache_bytes: Bytes of vision-tower outputs kept for images
            sent again (:mod:`.image_cache`; families of the Qwen-VL kind);
            0: none.
        make_state: Makes the batch from the model, the prompt cache and
            the prefill step size (the tensor-parallel leader's records
            what it does for the other ranks: :mod:`.distributed`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        thread: MLXThread,
        *,
        prompt_cache_bytes: int = 0,
        prefill_step_size: int = PREFILL_STEP,
        image_cache_bytes: int = 0,
        make_state: Callable[[LoadedModel, PromptCache, int], BatchState] = BatchState,
    ) -> None:
        self.loaded = loaded
        self.thread = thread
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.image_cache = install_image_cache(loaded.model, image_cache_bytes)
        self._state = make_state(loaded, self.prompt_cache, prefill_step_size)
        if self._state.exclusive:
            logger.warning("%s: serving one generation at a time", loaded.serial_reason)

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        thread: MLXThread,
        *,
        prompt_cache_bytes: int = 0,
        prefill_step_size: int = PREFILL_STEP,
        image_cache_bytes: int = 0,
    ) -> BatchEngine:
        """Load a model and make its engine; runs on ``thread`` (a start-up
        job of the middleware). See :class:`BatchEngine` for the options."""
        return cls(
            load(model_path),
            thread,
            prompt_cache_bytes=prompt_cache_bytes,
            prefill_step_size=prefill_step_size,
            image_cache_bytes=image_cache_bytes,
        )

    @property
    def context_length(self) -> int | None:
        """The model's context length in tokens, or None if unknown."""
        return self.loaded.context_length

    @property
    def longest_token_chars(self) -> int:
        """Characters in the longest token of the vocabulary."""
        return self.loaded.longest_token_chars

    @property
    def vocab_size(self) -> int:
        """Valid token ids are below it."""
        return self.loaded.vocab_size

    @property
    def chat_template(self) -> str | None:
        """The model's chat template, if it has one."""
        return self.loaded.chat_template

    @property
    def accepts_images(self) -> bool:
        """Whether the model takes images (False for a text-only model)."""
        return self.loaded.accepts_images

    @property
    def loaded_at(self) -> float:
        """When the load ended (Unix time)."""
        return self.loaded.loaded_at

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters."""
        return self.loaded.weight_bytes

    def statistics(self) -> BatchStatistics:
        """A snapshot of the batch; any thread (it may be a step old)."""
        return self._state.statistics()

    def counters(self) -> EngineCounters:
        """A snapshot for metrics and ``/health``; any thread."""
        batch, cache = self._state.statistics(), self.prompt_cache.statistics()
        return EngineCounters(
            rows=batch.active + batch.joining,
            kv_bytes=self._state.kv_bytes(),
            prompt_cache_hits=cache.hits,
            prompt_cache_misses=cache.misses,
            prompt_cache_reused_tokens=cache.reused_tokens,
            prompt_cache_bytes=cache.bytes,
            ranks=self._state.ranks(),
        )

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image] = ()
    ) -> EventStream:
        """Start a generation on the MLX thread; its events, on the event loop.

        Any thread. The generation's first turn on the MLX thread only queues
        its prompt and gives the thread to the next request, so requests that
        arrive together are prefilled together. Bound the streams open at
        once (the server's gate does) and close each one.

        Args:
            params: The request's parameters.
            images: The decoded images, in prompt order.

        Returns:
            An async iterator of :class:`~..events.TokenEvent`, then one
            :class:`~..events.FinalEvent`, with ``aclose()``; closing it (or
            cancelling its consumer) takes the sequence out of the batch on
            the thread.
        """
        return EventStream(
            self.thread.iterate(self._generate, params, images, announce=True)
        )

    def generate_stream(
        self, params: GenerationParams, images: Sequence[Image.Image] = ()
    ) -> Generator[Event, None, None]:
        """Generate a chat completion token by token, batched with the others.

        A sync generator to run on the MLX thread with ``MLXThread.iterate``,
        one event per turn. Closing it takes its sequence out of the batch;
        the other sequences go on. (:meth:`stream` is faster under load: it
        lets requests that arrive together be prefilled together.)

        Args:
            params: The request's parameters.
            images: The decoded images, in prompt order.

        Yields:
            A :class:`~..events.TokenEvent` per generated token, then one
            :class:`~..events.FinalEvent`.

        Raises:
            Whatever the processor or the model raise for this request; an
            error in a batched step is raised by every request in that step.
        """
        events = self._generate(params, images, announce=False)
        return cast("Generator[Event, None, None]", events)

    def _generate(
        self,
        params: GenerationParams,
        images: Sequence[Image.Image],
        *,
        announce: bool,
    ) -> Generator[Event | Handoff, None, None]:
        """The generator; with ``announce``, its first item is ``HANDOFF``:
        the request is queued for prefill, and the thread goes to others;
        so is each turn that only ran a chunk of its long prompt."""
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be 1 or more, not {params.max_tokens}")
        start = time.perf_counter()
        state = self._state
        row = state.admit(params, images)
        text = SequenceText(self.loaded)
        matcher = StopMatcher(params.stop)
        finish: FinishReason = "length"
        tail = ""
        completion = 0
        first_token_at: float | None = None
        try:
            if announce:
                yield HANDOFF
            while True:
                if not row.pending:
                    if row.error is not None:
                        raise row.error
                    if row.done:  # max_tokens sampled, and all handed out
                        tail, stopped = matcher.feed(text.finish())
                        finish = "stop" if stopped else "length"
                        break
                    # A queued row gets its first token from the step that
                    # prefills it (or, when its prompt's last token is left to
                    # the decode step, from the one after): a few steps at
                    # most; a long prompt takes a step per chunk, and gives
                    # the thread away after each (through ``stream``).
                    for _ in range(3):
                        state.step()
                        if row.pending or row.error is not None:
                            break
                        if state.prefilling_now(row) or state.held(row):
                            if announce:
                                yield HANDOFF
                            break
                    else:  # pragma: no cover
                        raise RuntimeError("a batched step skipped a sequence")
                    continue
                item = row.pending.popleft()
                if item.eos:
                    tail, _ = matcher.feed(text.finish())
                    finish = "stop"
                    break
                piece, stopped = matcher.feed(text.add(item.token))
                completion += 1
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                logprobs = self._logprobs(item) if params.logprobs else None
                yield TokenEvent(piece, logprobs)
                if stopped:
                    finish = "stop"
                    break
        finally:
            state.leave(row)
        tail += matcher.flush()  # held back as a possible stop string: it was not
        end = time.perf_counter()
        first = first_token_at or end
        yield FinalEvent(
            text=tail,
            finish_reason=finish,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=completion,
            prefill_seconds=first - start,
            decode_seconds=end - first,
            cached_tokens=row.cached,
        )

    def _logprobs(self, item: Sampled) -> TokenLogprobs:
        token_text = self.loaded.token_text
        text, raw = token_text(item.token)
        top = []
        for index, value in item.top:
            alt_text, alt_raw = token_text(index)
            top.append((alt_text, value, alt_raw))
        return TokenLogprobs(text, item.logprob, raw, top)
