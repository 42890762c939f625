"""The decode batch of one model: admission, prefill, pipelined steps.

Everything here runs on the MLX thread and is touched by nothing else, so it
holds no locks. :mod:`.batching` drives it, one request generator per
sequence; this module knows only rows, caches and steps. Rows are admitted
(preprocessed and queued), prefilled together at the next step
(:mod:`._batch_prefill`), join the batch, are decoded one token per step
(:mod:`._batch_sampling`), and leave when done or closed.

Per-sequence state that mlx-vlm's Qwen-VL language models keep on the model
object (``_rope_deltas``, ``_position_ids``) is kept here per row instead: a
sequence's rope delta is captured at its prefill and every batched step
passes the deltas of all rows explicitly (``rope_deltas=(B, 1)``), together
with per-row cache offsets, so no row ever reads another's state.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import mlx.core as mx
import numpy as np

from ..events import GenerationParams
from .admission import make_row, media_tokens
from .logits import (
    advance,
    bias_rows,
    constrain,
    fill_masks,
    mask,
    penalize,
    speculates,
)
from .model import LoadedModel
from .prefill import (
    PREFILL_STEP,
    ChunkedPrefill,
    Prefilled,
    Prepared,
    batchable,
    prefill_together,
)
from .prompt_cache import Key, PromptCache
from .rows import BatchStatistics, Row
from .sampling import Draw, Sampled, collect, draw, vlm

if TYPE_CHECKING:
    from PIL import Image

# Prompts prefilled together at most (mlx-vlm's default prefill batch).
PREFILL_BATCH = 8
# Grammar rows stop speculating for a while when more than SPECULATION_MISSES
# of the batch's last SPECULATION_WINDOW speculative steps were built again.
SPECULATION_WINDOW = 16
SPECULATION_MISSES = 4
SPECULATION_PAUSE = 64


class BatchState:
    """The rows of one model and their batched KV cache (MLX thread only).

    Rows enter through :meth:`admit`, are prefilled and join the batch in
    the next :meth:`step`, and leave through :meth:`leave` or when they are
    done; rows that left are dropped from the cache at the next step, or at
    once when none remain.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prompt_cache: PromptCache | None = None,
        prefill_step: int = PREFILL_STEP,
        exclusive: bool | None = None,
    ) -> None:
        self.loaded = loaded
        # One row at a time, each prefilled alone with mlx-vlm's own caches:
        # for families the batch is not proven exact on (None: by family).
        self.exclusive = not loaded.batches_exactly if exclusive is None else exclusive
        self.prefill_step = prefill_step
        self.prompt_cache = prompt_cache or PromptCache(0)
        # Only plain KV caches can be cut at any token and reused.
        layers = vlm().make_prompt_cache(loaded.model.language_model)
        self._reusable = all(type(c).__name__ == "KVCache" for c in layers)
        self._media = media_tokens(loaded)
        self.lm: Any = loaded.model.language_model
        self.mrope = hasattr(self.lm, "_rope_deltas")
        self.rows: list[Row] = []
        self.waiting: list[Row] = []  # admitted, not yet prefilled
        self.joining: list[tuple[list[Row], Prefilled]] = []  # prefilled
        # Long prompts prefilled a chunk per step, oldest first.
        self.prefilling: list[tuple[Row, ChunkedPrefill]] = []
        self.leaving: set[Row] = set()
        self.cache: list[Any] | None = None
        self.deltas: mx.array | None = None
        self._bias: mx.array | None = None  # (B, V), None when no row biases
        # The step started and not yet collected: its rows and its draw.
        self._inflight: tuple[list[Row], Draw] | None = None
        self._bias_stale = True
        # Whether each recent speculative step was built again, and how many
        # steps speculation waits (see _speculative). Only on the CPU backend,
        # where the masks compete with the forward pass for the same cores;
        # elsewhere they are computed while the pass runs on the device.
        self._speculating = mx.default_device() == mx.cpu
        self._rebuilt: collections.deque[bool] = collections.deque(
            maxlen=SPECULATION_WINDOW
        )
        self._paused = 0
        self._stop = loaded.tokenizer.stopping_criteria
        self.peak_active = self.steps = self.decoded = self.prefills = 0
        self.passes = 0
        self.prefill_seconds = self.step_seconds = 0.0

    def statistics(self) -> BatchStatistics:
        return BatchStatistics(
            active=len(self.rows) - len(self.leaving),
            joining=len(self.waiting)
            + len(self.prefilling)
            + sum(not r.gone for rows, _ in self.joining for r in rows),
            peak_active=self.peak_active,
            steps=self.steps,
            decoded_tokens=self.decoded,
            prefills=self.prefills,
            prefill_passes=self.passes,
            prefill_seconds=self.prefill_seconds,
            step_seconds=self.step_seconds,
        )

    def ranks(self) -> tuple[int, ...]:
        """The rows each rank of a tensor-parallel group holds; () alone."""
        return ()

    def kv_bytes(self) -> int:
        """Bytes of KV held by the batch and the rows about to join it."""
        caches = [*(self.cache or ()), *(c for _, g in self.joining for c in g.cache)]
        caches += [c for _, job in self.prefilling for c in job.cache]
        return sum(int(getattr(c, "nbytes", 0)) for c in caches)

    # -- entering ------------------------------------------------------------

    def admit(self, params: GenerationParams, images: Sequence[Image.Image]) -> Row:
        """Preprocess a request (chat template, processor) and queue it.

        Its prompt is prefilled at the next :meth:`step`, together with the
        others queued by then, and joins the decode batch there. Raises what
        :func:`.admission.make_row` raises; nothing is queued then.
        """
        keyed = self.prompt_cache.enabled and self._reusable
        row = make_row(
            self.loaded, params, images, media=self._media if keyed else None
        )
        self.waiting.append(row)
        return row

    def _prefill_waiting(self) -> bool:
        """Prefill the queued prompts: up to :data:`PREFILL_BATCH` together,
        the others alone. A failing prompt fails its own request only.
        Whether any of them got its first token (or its error) here."""
        waiting = [row for row in self.waiting if not row.gone]
        self.waiting = []
        if self.exclusive:
            # The next row starts once no other is in the batch.
            held = waiting if self._busy() else waiting[1:]
            self.waiting, waiting = held, waiting[: len(waiting) - len(held)]
        if not waiting and not self.prefilling:
            return False
        start = time.perf_counter()
        prefixes = {row: self._reuse(row) for row in waiting if row.key is not None}
        step = self.prefill_step
        together = [
            r
            for r in waiting
            if not self.exclusive
            and not prefixes.get(r)
            and batchable(self.loaded, _prepared(r), step)
        ]
        alone = [r for r in waiting if r not in together]
        for i in range(0, len(together), PREFILL_BATCH):
            rows = together[i : i + PREFILL_BATCH]
            self.passes += 1
            try:
                group = prefill_together(self.loaded, [_prepared(r) for r in rows])
                self._first_tokens(rows, group)
            except Exception:  # find the culprit: each alone (none sampled yet)
                alone += rows
            else:
                self._joined(rows, group)
        for row in alone:
            try:
                job = ChunkedPrefill(
                    self.loaded, _prepared(row), prefixes.get(row, ()), step
                )
            except Exception as exc:
                row.error, row.done = exc, True
                continue
            self.prefilling.append((row, job))
        ended = [row for row in waiting if row.error is not None]
        ended += self._advance_prefill()
        self.prefills += len(waiting)
        self.prefill_seconds += time.perf_counter() - start
        return any(row.pending or row.error is not None for row in [*waiting, *ended])

    def _advance_prefill(self) -> list[Row]:
        """Run one chunk of the oldest long prompt being prefilled, so the
        decode step after it is not held up by the whole prompt; the row, if
        this chunk ended its prefill."""
        self.prefilling = [(r, job) for r, job in self.prefilling if not r.gone]
        if not self.prefilling:
            return []
        row, job = self.prefilling[0]
        self.passes += 1
        try:
            group = job.advance()
            if group is None:
                return []
            self._first_tokens([row], group)
        except Exception as exc:
            row.error, row.done = exc, True
        else:
            self._joined([row], group)
        self.prefilling.pop(0)
        return [row]

    def _busy(self) -> bool:
        """Whether a row is in the batch, joining it or being prefilled."""
        joining = [row for rows, _ in self.joining for row in rows]
        live = [r for r in (*self.rows, *joining) if r not in self.leaving]
        return bool(self.prefilling) or any(not (r.gone or r.done) for r in live)

    def held(self, row: Row) -> bool:
        """Whether ``row`` waits for the batch to empty (``exclusive``)."""
        return row in self.waiting

    def prefilling_now(self, row: Row) -> bool:
        """Whether ``row``'s long prompt is being prefilled in chunks."""
        return any(r is row for r, _ in self.prefilling)

    def _first_tokens(self, rows: list[Row], group: Prefilled) -> None:
        """Sample the rows' first tokens from their prefill's logits, if it
        kept them (else the decode step samples them)."""
        logits = group.logits
        if logits is None:
            return
        logits = penalize(logits, rows)
        logits = constrain(logits, [row.matcher for row in rows])
        bias = bias_rows(rows, logits)
        states = [c.state for c in group.cache]
        firsts = collect(draw(logits, rows, bias, states), self._stop)
        for row, first in zip(rows, firsts, strict=True):
            self._record(row, first)
        advance(rows)

    def _joined(self, rows: list[Row], group: Prefilled) -> None:
        for i, row in enumerate(rows):
            row.prepared = None
            if row.key is not None:
                self._store(row.key, group.cache, i)
        self.joining.append((rows, group))

    def _reuse(self, row: Row) -> list[tuple[mx.array, mx.array]]:
        """The cached KV of the longest prefix of ``row``'s prompt; at least
        its last token is left to run, for its first token's logits."""
        assert row.key is not None
        prefix, row.cached = self.prompt_cache.lookup(row.key, len(row.key) - 1)
        return prefix

    def _store(self, key: Key, cache: Sequence[Any], index: int) -> None:
        """Cache the KV of row ``index`` of a batch ``cache``, under as much
        of ``key`` as it holds."""
        layers = [c.extract(index) for c in cache]
        tokens = layers[0].offset
        if 0 < tokens <= len(key):
            self.prompt_cache.store(key[:tokens], [(c.keys, c.values) for c in layers])

    # -- leaving -------------------------------------------------------------

    def leave(self, row: Row) -> None:
        """Take ``row`` out: now if it has not joined, else at the next step."""
        row.gone = True
        if row in self.waiting:
            self.waiting.remove(row)
        elif self.prefilling_now(row):
            self.prefilling = [(r, job) for r, job in self.prefilling if r is not row]
        elif row in self.rows:
            self.leaving.add(row)
            if len(self.leaving) == len(self.rows):
                self._inflight = None  # nobody is left to read it
                self._compact()
        else:
            # A row still joining is dropped when its group joins; a group
            # with nobody left is dropped now, its cache with it.
            self.joining = [
                (rows, group)
                for rows, group in self.joining
                if not all(r.gone or r.done for r in rows)
            ]

    def _compact(self) -> None:
        if not self.leaving:
            return
        for i, row in enumerate(self.rows):
            # The prompt and the answer so far: the next turn of a chat
            # starts with both.
            if row in self.leaving and row.key is not None and row.error is None:
                answer = np.asarray(row.tokens, dtype=np.int64)
                self._store(np.concatenate([row.key, answer]), self.cache or (), i)
        keep = [i for i, row in enumerate(self.rows) if row not in self.leaving]
        self.leaving.clear()
        self._bias_stale = True
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
        self._unmask_if_unpadded()

    def _join(self) -> None:
        joining, self.joining = self.joining, []
        for rows, group in joining:
            # Rows that left, or whose first token was also their last.
            keep = [i for i, row in enumerate(rows) if not (row.gone or row.done)]
            if not keep:
                continue
            cache, deltas = group.cache, group.deltas
            if len(keep) < len(rows):
                index = mx.array(keep, dtype=mx.int32)
                for c in cache:
                    c.filter(index)
                deltas = deltas[index] if deltas is not None else None
            self._bias_stale = True
            if self.cache is None:
                self.cache = cache
            else:
                for mine, theirs in zip(self.cache, cache, strict=True):
                    mine.extend(theirs)
            if deltas is not None:
                parts = [deltas] if self.deltas is None else [self.deltas, deltas]
                self.deltas = mx.concatenate(parts, axis=0)
            self.rows.extend(rows[i] for i in keep)
        if joining:
            self._unmask_if_unpadded()

    def _unmask_if_unpadded(self) -> None:
        """Let decode steps skip the attention mask while no row is padded.

        A one-token step's causal mask is all true; ``BatchKVCache`` still
        builds one every step to hide left padding, and attention with a
        mask array is the slower kernel (docs/benchmarks.md has the cost).
        The model asks the first layer's cache for the mask, so only that
        cache answers None for one-token steps, and only while every row's
        left padding is 0 (read here, on joins and leaves, not per step).
        Masked or not, the numbers are the same (tested).
        """
        first = self.cache[0] if self.cache else None
        # A recurrent layer's state (Qwen3.5) has no padding to read.
        if first is None or getattr(first, "left_padding", None) is None:
            return
        first.__dict__.pop("make_mask", None)  # the class's own, masking
        if not any(cast("list[int]", first.left_padding.tolist())):
            first.make_mask = _unmasked_steps(first.make_mask)

    # -- decoding ------------------------------------------------------------

    def step(self) -> None:
        """One decode step for every row: one forward pass over the batch.

        Each row of the step gets one :class:`Sampled` in its ``pending``.
        Steps are pipelined, as mlx-vlm's own generation loop is: the next
        step is built on this step's tokens before they are computed, and
        started, before this one is read, so building a step can overlap
        computing the previous one (on the CPU backend starting it waits for
        the previous one: no gain measured at one row), and the next step
        computes while the thread hands out tokens. Rows that joined
        meanwhile enter it; rows that left are dropped from it; a row whose
        token here is its ``max_tokens``-th is left out of it; one that ends
        otherwise (end of turn, stop string) had its next row computed for
        nothing, and dropped. If a step fails, every row is failed with the
        error (their requests raise it; those whose last token it held too)
        and the batch is emptied; the caller gets the error too.
        """
        start = time.perf_counter()
        rows: list[Row] = []
        try:
            if self._inflight is None:
                idle = not self.rows and not self.joining
                if self._prefill_waiting() and idle:
                    # From idle: hand the first tokens out now, and start the
                    # decoding at the next step (on the CPU backend starting
                    # a step computes most of it). Only from idle: prompts
                    # that keep arriving must not hold the decoding back.
                    self.step_seconds += time.perf_counter() - start
                    return
                self._launch()
            inflight, self._inflight = self._inflight, None
            if inflight is None:
                return
            rows, pending = inflight
            # Prompts queued meanwhile: prefilled now, so they join the next
            # step (their prefill computes after this step, on one stream).
            self._prefill_waiting()
            last = {row for row in rows if row.sampled + 1 >= row.max_tokens}
            self.leaving |= last
            if self._constrained():
                # A grammar's mask needs this step's tokens: the next forward
                # pass starts on them unread, they are read and checked while
                # it computes, then its logits are masked and sampled. Where a
                # grammar refuses a token drawn without its mask, the row is
                # drawn again and the pass built again (_check, _rebuild).
                forward = self._forward(inflight, start=True)
                sampled = collect(pending, self._stop)
                consumed, refused = self._check(rows, pending, sampled)
                # Only a pass that holds a refused row's token is wrong.
                wrong = forward is not None and not refused.isdisjoint(forward.rows)
                if pending.speculative:
                    self._rebuilt.append(wrong)
                self._read(rows, sampled, last, consumed)
                if wrong and forward is not None:
                    forward = self._rebuild(forward)
                if forward is not None:
                    self._sample(forward, read=True)
                self.steps += 1
                self.step_seconds += time.perf_counter() - start
                return
            self._launch(inflight)
            sampled = collect(pending, self._stop)
        except BaseException as exc:
            self._fail(exc, rows)
            raise
        self._read(rows, sampled, last)
        self.steps += 1
        self.step_seconds += time.perf_counter() - start

    def _read(
        self,
        rows: list[Row],
        sampled: list[Sampled],
        last: set[Row],
        consumed: Collection[Row] = (),
    ) -> None:
        """Hand a step's tokens to its rows and advance their grammars (but
        those ``consumed`` already); rows in ``last`` left the batch already
        (the next step was built without them)."""
        read = []
        for row, item in zip(rows, sampled, strict=True):
            if row.gone or row.done:
                # It left while the step ran, or its token in the step before
                # ended it (end of turn): this one was computed ahead, for
                # nothing.
                continue
            self._record(row, item)
            self.decoded += 1
            read.append(row)
        advance([row for row in read if row not in consumed])
        for row in read:
            # Adding a row of ``last`` to the leaving again would count twice.
            if row.done and row not in last:
                self.leaving.add(row)

    def _constrained(self) -> bool:
        """Whether a row in the batch, or joining it, follows a grammar."""
        joining = [row for rows, _ in self.joining for row in rows]
        return any(
            row.matcher is not None and not (row.gone or row.done)
            for row in (*self.rows, *joining)
        )

    def _check(
        self, rows: list[Row], pending: Draw, sampled: list[Sampled]
    ) -> tuple[set[Row], set[Row]]:
        """Check the tokens of the rows drawn without their grammar's mask
        (:func:`.logits.speculates`).

        An allowed token is consumed by its row's matcher. The rows whose
        grammar refuses theirs are drawn again, from the same logits with the
        mask and the same keys, and their items in ``sampled`` replaced. The
        rows whose matchers consumed their token, and those refused.
        """
        consumed: set[Row] = set()
        refused: list[int] = []
        for i in pending.speculative:
            row = rows[i]
            if row.gone or row.done or row.matcher is None:
                continue  # not read (see _read)
            if row.matcher.try_consume(sampled[i].token):
                consumed.add(row)
            else:
                refused.append(i)
        if refused:
            assert pending.logits is not None
            again = [rows[i] for i in refused]
            vocab = pending.logits.shape[-1]
            allowed = fill_masks([row.matcher for row in again], vocab)
            assert allowed is not None
            index = mx.array(refused, dtype=mx.int32)
            logits = mask(pending.logits[index], allowed)
            bias = None if pending.bias is None else pending.bias[index]
            redrawn = collect(draw(logits, again, bias), self._stop)
            for i, item in zip(refused, redrawn, strict=True):
                sampled[i] = item
        return consumed, {rows[i] for i in refused}

    def _rebuild(self, forward: _Forward) -> _Forward | None:
        """The next forward pass again, on the step's tokens as read: the one
        started was built on a token its row's grammar refused. Its cache
        entries are cut off (every cache is a plain one: see
        :meth:`_speculative`) and the penalties' counts put back."""
        for c in self.cache or ():
            c.trim(1)
        for row, counts in zip(forward.rows, forward.counts, strict=True):
            row.counts = counts
        return self._forward(None, start=True)

    def _speculative(self, rows: list[Row]) -> list[int]:
        """The rows of a step built on read tokens to draw without their
        grammar's mask: those that can (:func:`.logits.speculates`) and
        whose grammar neither forces the next token nor may end here (the
        model's own pick would most likely be refused), while every cache
        can be cut back a token (:meth:`_rebuild`).

        A refusal costs the batch a forward pass, a mask a few tens of
        microseconds a row: when more than :data:`SPECULATION_MISSES` of
        the last :data:`SPECULATION_WINDOW` speculative steps were built
        again (rows whose models often pick what their grammar refuses, and
        refuse at different steps), every row is masked for the next
        :data:`SPECULATION_PAUSE` steps. It depends on the tokens only, so
        every rank of a sharded model decides alike.
        """
        caches = self.cache or ()
        if not self._speculating or not all(
            type(c).__name__ == "BatchKVCache" for c in caches
        ):
            return []
        if sum(self._rebuilt) > SPECULATION_MISSES:
            self._rebuilt.clear()
            self._paused = SPECULATION_PAUSE
        if self._paused:
            self._paused -= 1
            return []
        return [
            i
            for i, row in enumerate(rows)
            if speculates(row)
            and not row.done
            and row.matcher is not None
            and not row.matcher.forced()
        ]

    def _launch(self, inflight: tuple[list[Row], Draw] | None = None) -> None:
        """Build the next step for the rows still in, and start it. With the
        step ``inflight`` (not yet read), its rows' inputs are its tokens."""
        forward = self._forward(inflight)
        if forward is not None:
            self._sample(forward)

    def _forward(
        self, inflight: tuple[list[Row], Draw] | None, *, start: bool = False
    ) -> _Forward | None:
        """The next step's forward pass for the rows still in, penalized; with
        ``start``, started. None when no row is left."""
        self._compact()
        self._join()
        rows = list(self.rows)
        if not rows:
            return None
        ahead: list[int] = []
        # Which inputs are generated tokens (counted by the penalties), not
        # a prompt's last token left to this step.
        counted = [row.sampled > 0 for row in rows]
        if inflight is None:
            inputs = mx.array([row.token for row in rows], dtype=mx.uint32)
        else:
            # Rows of the step in flight come first, in order; joiners after.
            # Its tokens are uint32 already (argmax, and draws cast to it).
            previous, tokens = inflight[0], inflight[1].tokens
            position = {row: i for i, row in enumerate(previous)}
            carried = [position[row] for row in rows if row in position]
            ahead = [1 if row in position else 0 for row in rows]
            counted = [bool(a) or c for a, c in zip(ahead, counted, strict=True)]
            assert ahead == sorted(ahead, reverse=True), "joiners come last"
            parts = []
            if carried:
                same = carried == list(range(len(previous)))
                parts.append(
                    tokens if same else tokens[mx.array(carried, dtype=mx.int32)]
                )
            if len(carried) < len(rows):
                joined = [row.token for row in rows[len(carried) :]]
                parts.append(mx.array(joined, dtype=mx.uint32))
            inputs = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        kwargs: dict[str, Any] = {}
        if self.deltas is not None:
            kwargs["rope_deltas"] = self.deltas
        counts = [row.counts for row in rows]
        output = self.lm(inputs[:, None], cache=self.cache, **kwargs)
        logits = penalize(output.logits[:, -1, :], rows, inputs, counted)
        if start:
            mx.async_eval(logits, *(c.state for c in self.cache or ()))  # type: ignore[no-untyped-call]
        return _Forward(rows, logits, ahead, counts)

    def _sample(self, forward: _Forward, *, read: bool = False) -> None:
        """Mask, bias and sample a forward pass's logits, and start it: the
        next step in flight. With ``read``, the step before it was read
        since (its rows' positions count its tokens)."""
        rows = forward.rows
        speculative = self._speculative(rows) if read else []
        # A row that ended in the step read since has no next token to mask.
        matchers = [
            None if row.done or i in speculative else row.matcher
            for i, row in enumerate(rows)
        ]
        logits = constrain(forward.logits, matchers)
        bias = self._bias_matrix(rows, logits)
        states = [c.state for c in self.cache or ()]
        ahead = () if read else forward.ahead
        pending = draw(logits, rows, bias, states, ahead, speculative)
        self._inflight = (rows, pending)
        self.peak_active = max(self.peak_active, len(rows))

    def _record(self, row: Row, item: Sampled) -> None:
        row.pending.append(item)
        row.token = item.token
        row.sampled += 1
        row.done = item.eos or row.sampled >= row.max_tokens
        if row.key is not None:
            row.tokens.append(item.token)

    def _fail(self, exc: BaseException, reading: Sequence[Row] = ()) -> None:
        """Fail every row with ``exc``: those in the batch, joining, waiting,
        and those of the step being read (``reading``) that are not done:
        a row whose last token that step held has left the batch already."""
        joining = [row for rows, _ in self.joining for row in rows]
        joining += [row for row, _ in self.prefilling]
        unread = [row for row in reading if not row.done]
        for row in (*self.rows, *joining, *self.waiting, *unread):
            row.error = exc
            row.done = True
        self.rows, self.joining, self.waiting = [], [], []
        self.prefilling = []
        self.cache = self.deltas = None
        self._inflight = None
        self.leaving.clear()
        self._bias_stale = True

    def _bias_matrix(self, rows: list[Row], logits: mx.array) -> mx.array | None:
        """:func:`.logits.bias_rows` of the decode batch, kept until its rows
        change."""
        if self._bias_stale:
            self._bias_stale = False
            self._bias = bias_rows(rows, logits)
        return self._bias


class _Forward(NamedTuple):
    """A step's forward pass, penalized, not yet masked or sampled."""

    rows: list[Row]
    logits: mx.array
    ahead: list[int]  # see :func:`.sampling.draw`
    counts: list[mx.array | None]  # the rows' penalty counts before it


def _unmasked_steps(make_mask: Any) -> Any:
    def make(n: int, *args: Any, **kwargs: Any) -> Any:
        return None if n == 1 else make_mask(n, *args, **kwargs)

    return make


def _prepared(row: Row) -> Prepared:
    assert row.prepared is not None
    return row.prepared
