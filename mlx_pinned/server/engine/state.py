"""The rows of one model's batch and its batched KV cache; its scheduler,
:meth:`BatchState.step`. MLX thread only: nothing else touches it, so it
holds no locks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ..events import GenerationParams
from .batch_statistics import BatchStatistics, Tally
from .checkpoints import checker, kinds
from .decode import Decoder, Stepped
from .drafting import for_predictions
from .kv_quant import KVQuant, bytes_per_token, check_quantizable, held_bytes
from .model import LoadedModel
from .prefill import PREFILL_STEP, ChunkedPrefill, Prefilled
from .prefill_plan import PrefillPacer
from .prefills import PREFILL_BATCH, Prefills, PrefillSettings, store_row
from .prompt_cache import PromptCache
from .quirks import unmask_if_unpadded
from .rows import Row, make_row, media_tokens
from .sampling import vlm
from .step_failures import end_rows, fail_all, fail_batch

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["PREFILL_BATCH", "BatchState"]


class BatchState:
    """The rows of one model and their batched KV cache.

    Rows enter through :meth:`admit`, are prefilled and join the batch in a
    :meth:`step`, and leave through :meth:`leave` or when they are done.
    ``checkpoint_tokens`` and ``abandoned_tokens``: as the settings
    ``prefill_checkpoint_tokens`` and ``abandoned_prefill_tokens`` (0: off).

    Raises:
        SettingError: The model's cache cannot be quantized as ``kv_quant``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prompt_cache: PromptCache | None = None,
        prefill_step: int = PREFILL_STEP,
        exclusive: bool | None = None,
        kv_quant: KVQuant | None = None,
        prefill_seconds: float | None = None,
        checkpoint_tokens: int = 0,
        abandoned_tokens: int = 0,
    ) -> None:
        if kv_quant is not None:
            check_quantizable(loaded, kv_quant)
        self.kv_quant = kv_quant
        self._token_bytes = 0
        self.loaded = loaded
        # One row at a time, each prefilled alone with mlx-vlm's own caches:
        # for families the batch is not proven exact on (None: by family).
        alone = not loaded.batches_exactly if exclusive is None else exclusive
        self.prefill_step = prefill_step
        self.pacer = PrefillPacer(prefill_seconds, prefill_step)
        self.prompt_cache = prompt_cache or PromptCache(0)
        self.lm: Any = loaded.model.language_model
        layers = kinds(vlm().make_prompt_cache(self.lm))
        self._reusable = layers is not None
        self.prompt_cache.check = checker(self.lm)
        self._media = media_tokens(loaded)
        self.rows: list[Row] = []
        self.tally = Tally()
        settings = PrefillSettings(
            prefill_step, checkpoint_tokens, abandoned_tokens, alone, kv_quant
        )
        states = layers is not None and not all(layers)
        self.prefills = Prefills(
            loaded,
            self.prompt_cache,
            self.pacer,
            settings,
            self.tally,
            self._joined,
            states,
        )
        self.joining: list[tuple[list[Row], Prefilled]] = []  # prefilled
        self.leaving: set[Row] = set()
        self.cache: list[Any] | None = None
        self.deltas: mx.array | None = None
        self.decoder = Decoder()
        self.stage = "decode"  # of the strategy's calls: what a failure hit

    @property
    def exclusive(self) -> bool:
        """One row at a time, each prefilled alone with mlx-vlm's own caches."""
        return self.prefills.settings.exclusive

    @exclusive.setter
    def exclusive(self, value: bool) -> None:
        self.prefills.settings.exclusive = value

    def statistics(self) -> BatchStatistics:
        return self.tally.snapshot(
            active=len(self.rows) - len(self.leaving),
            joining=len(self.prefills.rows(live=True))
            + sum(not r.gone for rows, _ in self.joining for r in rows),
        )

    def draft_weight_bytes(self) -> int:
        drafting = self.decoder.drafting
        source = None if drafting is None else drafting.source
        return 0 if source is None else source.weight_bytes

    def idle(self) -> bool:
        """Whether no row is in the batch, joining it, queued or prefilled."""
        busy = self.rows or self.prefills or self.joining
        return not busy and self.decoder.inflight is None

    def ranks(self) -> tuple[int, ...]:
        """The rows each rank of a tensor-parallel group holds; () alone."""
        return ()

    def kv_bytes(self) -> int:
        """Bytes of KV held by the batch and the rows about to join it."""
        caches = [*(self.cache or ()), *(c for _, g in self.joining for c in g.cache)]
        caches += [c for _, job in self.prefilling for c in job.cache]
        return sum(held_bytes(c) for c in caches)

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV a token takes in the batch cache (every layer), as
        measured when rows last joined; 0 before the first did."""
        return self._token_bytes

    def admit(self, params: GenerationParams, images: Sequence[Image.Image]) -> Row:
        """Make a request a row and queue it for the next :meth:`step`'s
        prefill. Raises what :func:`.rows.make_row` raises (nothing queued).
        """
        keyed = self.prompt_cache.enabled and self._reusable
        row = make_row(
            self.loaded, params, images, media=self._media if keyed else None
        )
        if row.prediction is not None and self.decoder.drafting is None:
            self.decoder.drafting = for_predictions(self.loaded)
        if self.decoder.drafting is not None:
            self.decoder.drafting.start(row)
        self.prefills.add(row)
        return row

    @property
    def waiting(self) -> list[Row]:
        """Rows admitted whose prefill has not started."""
        started = {id(row) for row, _ in self.prefills.started()}
        return [r for r in self.prefills.rows() if id(r) not in started]

    @property
    def prefilling(self) -> list[tuple[Row, ChunkedPrefill]]:
        """Rows prefilled a chunk per step, and their jobs."""
        return self.prefills.started()

    def prefill(self) -> bool:
        """This step's prefill (:mod:`.prefills`); a failing prompt fails its own
        request only. Whether any prompt got its first token (or its error)."""
        if not self.prefills:
            return False
        start = time.perf_counter()
        decoding = any(not (r.gone or r.done) for r in self.rows)
        try:
            ended = self.prefills.step(decoding=decoding, busy=self._busy())
        except Exception as exc:  # no one prompt's: every prompt it held ends
            ended = [r for r in self.prefills.clear() if not r.done]
            end_rows(ended, "prefill", exc)
        self.tally.prefill_seconds += time.perf_counter() - start
        return any(row.pending or row.error is not None for row in ended)

    def _busy(self) -> bool:
        joining = [row for rows, _ in self.joining for row in rows]
        live = [r for r in (*self.rows, *joining) if r not in self.leaving]
        return any(not (r.gone or r.done) for r in live)

    def _joined(self, rows: list[Row], group: Prefilled) -> None:
        for i, row in enumerate(rows):
            row.prepared = None
            if group.scores:
                row.scores = group.scores[i]
            if row.key is not None:
                store_row(self.prompt_cache, row.key, group.cache, i)
        if not all(row.gone for row in rows):  # one whose client left: cached
            self.joining.append((rows, group))

    def leave(self, row: Row) -> None:
        """Take ``row`` out: now if it has not joined, else at the next step."""
        row.gone = True
        if self.prefills.leave(row):
            return
        if row in self.rows:
            self.leaving.add(row)
            if len(self.leaving) == len(self.rows):
                self.decoder.inflight = None  # nobody is left to read it
                self.compact()
        else:
            # A row still joining is dropped when its group joins; a group
            # with nobody left is dropped now, its cache with it.
            self.joining = [
                (rows, group)
                for rows, group in self.joining
                if not all(r.gone or r.done for r in rows)
            ]

    def compact(self) -> None:
        if not self.leaving:
            return
        for i, row in enumerate(self.rows):
            # The prompt and the answer so far: the next turn of a chat
            # starts with both.
            if row in self.leaving and row.key is not None and row.error is None:
                answer = np.asarray(row.tokens, dtype=np.int64)
                key = np.concatenate([row.key, answer])
                store_row(self.prompt_cache, key, self.cache or (), i)
        keep = [i for i, row in enumerate(self.rows) if row not in self.leaving]
        self.leaving.clear()
        self.decoder.bias_stale = True
        if not keep:
            self.rows, self.cache, self.deltas = [], None, None
            mx.clear_cache()
            return
        self.rows = [self.rows[i] for i in keep]
        index = mx.array(keep, dtype=mx.int32)
        for c in self.cache or ():
            c.filter(index)
        if self.deltas is not None:
            self.deltas = self.deltas[index]
        unmask_if_unpadded(self.cache)

    def join(self) -> None:
        joined = bool(self.joining)
        while self.joining:
            rows, group = self.joining.pop(0)
            # Rows that left, or whose first token was also their last.
            keep = [i for i, row in enumerate(rows) if not (row.gone or row.done)]
            if not keep:
                continue
            # In the batch before its cache is: a failure from here on ends
            # them with the batch's rows.
            self.rows.extend(rows[i] for i in keep)
            cache, deltas = group.cache, group.deltas
            if len(keep) < len(rows):
                index = mx.array(keep, dtype=mx.int32)
                for c in cache:
                    c.filter(index)
                deltas = deltas[index] if deltas is not None else None
            self.decoder.bias_stale = True
            if self.cache is None:
                self.cache = cache
            else:
                for mine, theirs in zip(self.cache, cache, strict=True):
                    mine.extend(theirs)
            if deltas is not None:
                parts = [deltas] if self.deltas is None else [self.deltas, deltas]
                self.deltas = mx.concatenate(parts, axis=0)
        if joined:
            unmask_if_unpadded(self.cache)
            self._token_bytes = bytes_per_token(self.cache or []) or self._token_bytes

    def step(self) -> None:
        """One step: the scheduler's prefill, leaves and joins, then exactly one
        strategy (docs/engine.md, "A turn, step by step").

        From idle, the prompts' first tokens are handed out at once and the
        decoding starts at the next step, so prompts that keep arriving do not
        hold it back. A failure ends the rows its stage touched, and no other
        (docs/engine.md, "When a step fails").
        """
        decoder = self.decoder
        start = time.perf_counter()
        reading = decoder.reading()  # the rows of the steps it reads
        idle = not self.rows and not self.joining and decoder.inflight is None
        try:
            stepped = None if self.prefill() and idle else self._strategy(reading)
        except Exception as exc:
            fail_batch(self, exc, reading)
            stepped = None
        except BaseException as exc:
            fail_all(self, exc, reading)
            raise
        if stepped is not None:
            self._apply(stepped)
        self.tally.step_seconds += time.perf_counter() - start

    def _strategy(self, reading: list[Row]) -> Stepped | None:
        """The rows of a step started here are added to ``reading``."""
        decoder = self.decoder
        self._settle()
        drafting = decoder.drafting
        if drafting is not None and drafting.applies(self):
            if decoder.inflight is not None:
                return decoder.drain()
            stepped = drafting.verify(self)
            if stepped is not None:
                return stepped
        if decoder.inflight is None:
            width = decoder.launch(self)
            if not width:
                return None
            reading += decoder.reading()
            self.tally.peak_active = max(self.tally.peak_active, width)
            self._settle()
        return decoder.pipelined(self)

    def _settle(self) -> None:
        """Rows whose token in flight is their last leave; the rows that left are
        dropped from the cache, and those prefilled join."""
        last = (r for r in self.decoder.reading() if r.sampled + 1 >= r.max_tokens)
        self.leaving.update(last)
        self.stage = "leave"
        self.compact()
        self.stage = "join"
        self.join()
        self.stage = "decode"

    def _apply(self, stepped: Stepped) -> None:
        """Count what a strategy did; its rows that ended leave the batch."""
        present = set(self.rows)
        self.leaving.update(r for r in stepped.read if r.done and r in present)
        tally = self.tally
        tally.steps += 1
        tally.decoded_tokens += stepped.tokens
        tally.peak_active = max(tally.peak_active, stepped.width)
        if stepped.speculative:
            tally.speculative_steps += 1
            tally.speculative_rows += stepped.width
            tally.draft_tokens += stepped.drafted
            tally.accepted_tokens += stepped.accepted
