"""The decode step of one model's batch: launch, forward, sample, record.

MLX thread only. A :class:`Decoder` belongs to one
:class:`~.state.BatchState` and runs its steps: one forward pass over every
row in the batch, one token each, pipelined as mlx-vlm's own generation loop
is (the next step is built on this step's tokens before they are read).
Grammar rows may draw unmasked through the :class:`~.speculation.Speculation`
policy, where it pays.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx

from .drafting import Drafting
from .logits import advance, bias_rows, constrain, penalize
from .prefill import Prefilled
from .rows import Row
from .sampling import Draw, Sampled, collect, draw
from .speculation import Speculation
from .thinking import force

if TYPE_CHECKING:
    from .state import BatchState

__all__ = ["Decoder", "Forward", "record"]


class Forward(NamedTuple):
    """A step's forward pass, penalized, not yet masked or sampled."""

    rows: list[Row]
    logits: mx.array
    ahead: list[int]  # see :func:`.sampling.draw`
    counts: list[mx.array | None]  # the rows' penalty counts before it


def record(row: Row, item: Sampled) -> None:
    """Give ``row`` a sampled token: its request reads it from ``pending``."""
    row.pending.append(item)
    row.token = item.token
    row.sampled += 1
    if row.thinking is not None:
        row.thinking.observe(item.token)
    row.done = item.eos or row.sampled >= row.max_tokens
    if row.key is not None:
        row.tokens.append(item.token)
    if row.history is not None:  # speculative decoding (.drafting)
        row.history.append(item.token)


class Decoder:
    """The steps of one batch, and the step in flight (MLX thread only).

    Attributes:
        speculation: The grammar speculation policy; None where it does not
            pay (off the CPU backend).
        stop: Whether a token ends a turn (the tokenizer's criteria).
    """

    def __init__(self, batch: BatchState) -> None:
        self.batch = batch
        self.stop: Any = batch.loaded.tokenizer.stopping_criteria
        self.speculation = Speculation() if mx.default_device() == mx.cpu else None
        # The step started and not yet collected: its rows and its draw.
        self.inflight: tuple[list[Row], Draw] | None = None
        self._bias: mx.array | None = None  # (B, V), None when no row biases
        self.bias_stale = True
        self.peak_active = self.steps = self.decoded = 0
        self.step_seconds = 0.0
        # Speculative decoding, when installed (.drafting.install).
        self.drafting: Drafting | None = None

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
        if self.drafting is not None and self.drafting.step(self):
            return  # a speculative step ran instead (.drafting)
        batch = self.batch
        start = time.perf_counter()
        try:
            if self.inflight is None:
                idle = not batch.rows and not batch.joining
                if batch.prefill_waiting() and idle:
                    # From idle: hand the first tokens out now, and start the
                    # decoding at the next step (on the CPU backend starting
                    # a step computes most of it). Only from idle: prompts
                    # that keep arriving must not hold the decoding back.
                    self.step_seconds += time.perf_counter() - start
                    return
                self._launch()
        except BaseException as exc:
            batch.fail(exc)
            raise
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            self._finish(inflight, start, launch=True)

    def drain(self) -> None:
        """Read the step in flight and start none after it: a speculative
        step (:mod:`.drafting`) follows, which needs its tokens read."""
        inflight, self.inflight = self.inflight, None
        assert inflight is not None, "no step in flight"
        self._finish(inflight, time.perf_counter(), launch=False)

    def _finish(
        self, inflight: tuple[list[Row], Draw], start: float, *, launch: bool
    ) -> None:
        """Read the step ``inflight``; with ``launch``, the next step is
        built on its tokens and started first (see :meth:`step`)."""
        batch = self.batch
        rows, pending = inflight
        try:
            # Prompts queued meanwhile: prefilled now, so they join the next
            # step (their prefill computes after this step, on one stream).
            batch.prefill_waiting()
            last = {row for row in rows if row.sampled + 1 >= row.max_tokens}
            batch.leaving |= last
            if launch:
                if self._constrained():
                    self._constrained_step(inflight, last, start)
                    return
                self._launch(inflight)
            sampled = collect(pending, self.stop)
        except BaseException as exc:
            batch.fail(exc, rows)
            raise
        self._read(rows, sampled, last)
        self.steps += 1
        self.step_seconds += time.perf_counter() - start

    def draft_weight_bytes(self) -> int:
        """Bytes of the draft model's parameters; 0 without one."""
        return 0 if self.drafting is None else self.drafting.source.weight_bytes

    def drafted(self) -> dict[str, int]:
        """The speculative steps' counts, as :class:`.rows.BatchStatistics`
        names them (none while speculation is off)."""
        drafting = self.drafting
        if drafting is None:
            return {}
        return {
            "speculative_steps": drafting.steps,
            "speculative_rows": drafting.rows,
            "draft_tokens": drafting.drafted,
            "accepted_tokens": drafting.accepted,
        }

    def _constrained_step(
        self, inflight: tuple[list[Row], Draw], last: set[Row], start: float
    ) -> None:
        """The step of a batch with a grammar row: a grammar's mask needs
        this step's tokens. The next forward pass starts on them unread,
        they are read and checked while it computes, then its logits are
        masked and sampled. Where a grammar refuses a token drawn without
        its mask, the row is drawn again and the pass built again
        (:meth:`.Speculation.check`, :meth:`.Speculation.rebuild`)."""
        rows, pending = inflight
        speculation = self.speculation
        forward = self._forward(inflight, start=True)
        sampled = collect(pending, self.stop)
        consumed: set[Row] = set()
        refused: set[Row] = set()
        if speculation is not None:
            consumed, refused = speculation.check(rows, pending, sampled, self.stop)
        # Only a pass that holds a refused row's token is wrong.
        wrong = forward is not None and not refused.isdisjoint(forward.rows)
        if speculation is not None and pending.speculative:
            speculation.built(wrong)
        self._read(rows, sampled, last, consumed)
        if wrong and forward is not None and speculation is not None:
            again = functools.partial(self._forward, None, start=True)
            forward = speculation.rebuild(forward, self.batch.cache or (), again)
        if forward is not None:
            self._sample(forward, read=True)
        self.steps += 1
        self.step_seconds += time.perf_counter() - start

    def first_tokens(self, rows: list[Row], group: Prefilled) -> None:
        """Sample the rows' first tokens from their prefill's logits, if it
        kept them (else the decode step samples them)."""
        if self.drafting is not None:
            self.drafting.start(rows)
        logits = group.logits
        if logits is None:
            return
        logits = penalize(logits, rows)
        logits = constrain(logits, [row.matcher for row in rows])
        logits = force(logits, rows)
        bias = bias_rows(rows, logits)
        states = [c.state for c in group.cache]
        firsts = collect(draw(logits, rows, bias, states), self.stop)
        for row, first in zip(rows, firsts, strict=True):
            record(row, first)
        advance(rows)

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
            record(row, item)
            self.decoded += 1
            read.append(row)
        advance([row for row in read if row not in consumed])
        for row in read:
            # Adding a row of ``last`` to the leaving again would count twice.
            if row.done and row not in last:
                self.batch.leaving.add(row)

    def _constrained(self) -> bool:
        """Whether a row in the batch, or joining it, follows a grammar or
        may have its thinking's closing marker forced: its next mask needs
        its last token read."""
        batch = self.batch
        joining = [row for rows, _ in batch.joining for row in rows]
        return any(
            (row.matcher is not None or (row.thinking and row.thinking.open))
            and not (row.gone or row.done)
            for row in (*batch.rows, *joining)
        )

    def _launch(self, inflight: tuple[list[Row], Draw] | None = None) -> None:
        """Build the next step for the rows still in, and start it. With the
        step ``inflight`` (not yet read), its rows' inputs are its tokens."""
        forward = self._forward(inflight)
        if forward is not None:
            self._sample(forward)

    def _forward(
        self, inflight: tuple[list[Row], Draw] | None, *, start: bool = False
    ) -> Forward | None:
        """The next step's forward pass for the rows still in, penalized; with
        ``start``, started. None when no row is left."""
        batch = self.batch
        batch.compact()
        batch.join()
        rows = list(batch.rows)
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
        if batch.deltas is not None:
            kwargs["rope_deltas"] = batch.deltas
        counts = [row.counts for row in rows]
        output = batch.lm(inputs[:, None], cache=batch.cache, **kwargs)
        logits = penalize(output.logits[:, -1, :], rows, inputs, counted)
        if start:
            mx.async_eval(logits, *(c.state for c in batch.cache or ()))  # type: ignore[no-untyped-call]
        return Forward(rows, logits, ahead, counts)

    def _sample(self, forward: Forward, *, read: bool = False) -> None:
        """Mask, bias and sample a forward pass's logits, and start it: the
        next step in flight. With ``read``, the step before it was read
        since (its rows' positions count its tokens)."""
        rows = forward.rows
        speculation = self.speculation
        speculative: list[int] = []
        if read and speculation is not None:
            speculative = speculation.pick(rows, self.batch.cache or ())
        # A row that ended in the step read since has no next token to mask.
        matchers = [
            None if row.done or i in speculative else row.matcher
            for i, row in enumerate(rows)
        ]
        logits = constrain(forward.logits, matchers)
        # The rows' budgets are current: a step built before its rows' last
        # tokens are read has no row still thinking (see _constrained).
        logits = force(logits, rows)
        bias = self._bias_matrix(rows, logits)
        states = [c.state for c in self.batch.cache or ()]
        ahead = () if read else forward.ahead
        pending = draw(logits, rows, bias, states, ahead, speculative)
        self.inflight = (rows, pending)
        self.peak_active = max(self.peak_active, len(rows))

    def _bias_matrix(self, rows: list[Row], logits: mx.array) -> mx.array | None:
        """:func:`.logits.bias_rows` of the decode batch, kept until its rows
        change."""
        if self.bias_stale:
            self.bias_stale = False
            self._bias = bias_rows(rows, logits)
        return self._bias
