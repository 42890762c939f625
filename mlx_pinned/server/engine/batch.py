"""A chat model's engine: its batch (:class:`~.state.BatchState`) and the
loop that owns it (:class:`~.loop.BatchLoop`), which runs on the MLX
thread; requests come from the event loop. docs/engine.md explains both.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

from ..events import ChatFacts, EventStream, GenerationParams
from ..formats import ModelFormats, log_formats, model_formats
from ..resident import EngineCounters
from .batch_statistics import BatchStatistics
from .disk_format import model_fingerprint
from .drafting import DraftSettings
from .drafting import install as install_drafting
from .driver import LoopDriver
from .image_cache import install as install_image_cache
from .kv_quant import KVQuant
from .loop import BatchLoop
from .memory import kv_bytes_per_token
from .model import LoadedModel, load
from .model_inputs import preprocess, prompt_tokens
from .native_drafter import carries_mtp
from .prefill import PREFILL_STEP
from .prompt_cache import PromptCache
from .prompt_disk import DiskTier
from .state import BatchState

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread

    from ..config import ModelSettings

__all__ = ["BatchEngine", "BatchStatistics"]

logger = logging.getLogger("mlx_pinned.server")


class BatchEngine:
    """One chat model's continuous batching: the :class:`~..events.Engine` the
    HTTP side uses. :meth:`stream` runs on the event loop, :meth:`statistics`
    and :meth:`counters` on any thread.

    Args:
        prefill_step_seconds: Seconds a chunk of a long prompt should take
            while other rows decode (:class:`.PrefillPacer`); None: a chunk is
            ``prefill_step_size`` tokens.
        formats: Its output formats (None: those its chat template shows).
        make_state: Makes the batch from the model, the prompt cache and the
            prefill step size (the tensor-parallel leader's records what it
            does: :mod:`.distributed`).

    Attributes:
        facts: What the model is (its limits, inputs, template and formats).
        disk: The caches' disk tier (None: memory only; :meth:`attach`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        thread: MLXThread,
        *,
        prompt_cache_bytes: int = 0,
        prefill_step_size: int = PREFILL_STEP,
        prefill_step_seconds: float | None = None,
        image_cache_bytes: int = 0,
        make_state: Callable[[LoadedModel, PromptCache, int], BatchState] | None = None,
        formats: ModelFormats | None = None,
    ) -> None:
        self.loaded = loaded
        self.thread = thread
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.image_cache = install_image_cache(loaded.model, image_cache_bytes)
        self.disk: DiskTier | None = None
        if make_state is None:
            make_state = functools.partial(
                BatchState, prefill_seconds=prefill_step_seconds
            )
        self._state = make_state(loaded, self.prompt_cache, prefill_step_size)
        lm = loaded.model.language_model
        self.facts = ChatFacts(
            context_length=loaded.context_length,
            vocab_size=loaded.vocab_size,
            longest_token_chars=loaded.longest_token_chars,
            accepts_images=loaded.accepts_images,
            chat_template=loaded.chat_template,
            formats=formats or model_formats(loaded.chat_template),
            audio_input=loaded.audio_input,
            kv_bytes_per_token=kv_bytes_per_token(lm, self._state.kv_quant),
        )
        self.loop = BatchLoop(self._state)
        self._driver = LoopDriver(self.loop, thread)
        if self._state.exclusive:
            logger.warning("%s: serving one generation at a time", loaded.serial_reason)

    @classmethod
    def load(cls, settings: ModelSettings, thread: MLXThread) -> BatchEngine:
        """Load a chat model and make its engine as ``settings`` say; runs
        on ``thread`` (a start-up job)."""
        loaded = load(settings.path)
        formats = output_formats(loaded, settings)
        quant = None
        if settings.kv_bits is not None:
            quant = KVQuant(settings.kv_bits, settings.kv_group_size)
        seconds = settings.prefill_step_seconds
        engine = cls(
            loaded,
            thread,
            formats=formats,
            prompt_cache_bytes=settings.prompt_cache_bytes,
            prefill_step_size=settings.prefill_step_size,
            prefill_step_seconds=seconds,
            image_cache_bytes=settings.image_cache_bytes,
            make_state=functools.partial(
                BatchState,
                kv_quant=quant,
                prefill_seconds=seconds,
                checkpoint_tokens=settings.prefill_checkpoint_tokens,
                abandoned_tokens=settings.abandoned_prefill_tokens,
            ),
        )
        if settings.prompt_cache_dir is not None:
            quantized = "" if quant is None else f"{quant.bits}/{quant.group_size}"
            fingerprint = model_fingerprint(loaded.path, quantized)
            folder = settings.prompt_cache_dir / fingerprint[:16]
            budget = settings.prompt_cache_disk_bytes
            engine.attach(DiskTier(folder, budget, fingerprint))
        drafts = DraftSettings(
            settings.prompt_lookup_tokens,
            settings.num_draft_tokens,
            settings.draft_model,
            settings.draft_max_batch,
        )
        if drafts.ngram or drafts.model is not None:
            engine.speculate(drafts)
        elif settings.mtp and carries_mtp(loaded.path):
            engine.speculate(dataclasses.replace(drafts, mtp=True))
        return engine

    def attach(self, disk: DiskTier) -> None:
        """MLX thread, before the first request."""
        self.disk = disk
        self.prompt_cache.attach(disk)
        if self.image_cache is not None:
            self.image_cache.attach(disk)

    def speculate(self, drafts: DraftSettings) -> None:
        """Turn speculative decoding on; MLX thread, before the first request.

        Raises:
            SettingError: As :func:`.drafting.install`.
        """
        install_drafting(self._state, drafts)

    @property
    def loaded_at(self) -> float:
        return self.loaded.loaded_at

    @property
    def weight_bytes(self) -> int:
        """Its parameters' bytes, and its draft model's."""
        return self.loaded.weight_bytes + self._state.draft_weight_bytes()

    def statistics(self) -> BatchStatistics:
        """A snapshot of the batch, perhaps a step old; any thread.
        Requests submitted and not yet admitted count as joining."""
        stats = self._state.statistics()
        queued = self.loop.queued()
        return dataclasses.replace(stats, joining=stats.joining + queued)

    def counters(self) -> EngineCounters:
        """A snapshot for metrics and ``/health``; any thread."""
        batch, cache = self._state.statistics(), self.prompt_cache.statistics()
        return EngineCounters(
            rows=batch.active + batch.joining,
            kv_bytes=self._state.kv_bytes(),
            kv_bytes_per_token=self._state.kv_bytes_per_token(),
            prompt_cache_hits=cache.hits,
            prompt_cache_misses=cache.misses,
            prompt_cache_reused_tokens=cache.reused_tokens,
            prompt_cache_bytes=cache.bytes,
            ranks=self._state.ranks(),
            decode_steps=batch.steps,
            decoded_tokens=batch.decoded_tokens,
            speculative_steps=batch.speculative_steps,
            speculative_rows=batch.speculative_rows,
            draft_tokens=batch.draft_tokens,
            accepted_tokens=batch.accepted_tokens,
            image_cache_bytes=0
            if self.image_cache is None
            else self.image_cache.held.bytes,
            disk_cache_bytes=0 if self.disk is None else self.disk.nbytes,
            # The allocator's counters: read from any thread, no stream.
            mlx_memory=(
                mx.get_active_memory(),
                mx.get_cache_memory(),
                mx.get_peak_memory(),
            ),
        )

    async def lend_cache(self, nbytes: int) -> None:
        """Keep the prompt cache ``nbytes`` under its budget (its oldest
        entries past that dropped now, on the MLX thread): bytes the requests'
        charges borrow from it."""
        await self.thread.run(self.prompt_cache.lend, nbytes)

    async def tokenize(self, params: GenerationParams) -> tuple[tuple[int, str], ...]:
        """The tokens a generation of ``params`` would prefill (no images), each
        with its text as log-probabilities show it; a job of the MLX thread."""
        return await self.thread.run(prompt_tokens, self.loaded, params)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """Decoded on the MLX thread."""
        tokenizer = self.loaded.tokenizer
        return str(await self.thread.run(tokenizer.decode, list(tokens)))

    async def count_tokens(
        self, params: GenerationParams, images: Sequence[Image.Image] = ()
    ) -> int:
        """The tokens a generation of ``params`` would prefill, images included; a
        job of the MLX thread."""
        return await self.thread.run(_count_tokens, self.loaded, params, images)

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image] = ()
    ) -> EventStream:
        """Submit a generation to the model's loop (started here if it is not
        running), which admits it at its next turn. Event loop only; bound the
        streams open at once (the server's gate does) and close each one.

        Returns:
            :class:`~..events.TokenEvent` items, then one
            :class:`~..events.FinalEvent`; closing the stream (or cancelling its
            consumer) takes the row out at the loop's next turn. It raises what
            the processor or the model raise for this request, and a batched
            step's error in every request of the step.

        Raises:
            MLXThreadClosedError: The thread is closed.
            MLXThreadBusyError: The thread's queue is full.
        """
        return self._driver.stream(params, images)


def _count_tokens(
    loaded: LoadedModel, params: GenerationParams, images: Sequence[Image.Image]
) -> int:
    return preprocess(loaded, params, images).prompt_tokens


def output_formats(loaded: LoadedModel, settings: ModelSettings) -> ModelFormats:
    """Those its settings name, else those its chat template shows; logged in
    one line."""
    formats = model_formats(
        loaded.chat_template,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
    )
    log_formats(
        settings.name,
        formats,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
    )
    return formats
