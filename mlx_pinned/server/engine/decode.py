"""The pipelined decode step strategies of one model's batch, plain and
constrained (:class:`Decoder`): the next step is built on this step's
tokens before they are read, as mlx-vlm's loop does. MLX thread only.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx

from .logits import ban_words, bias_rows, constrain, penalize
from .prefill import Prefilled
from .rows import Row, read
from .sampling import Draw, collect, draw
from .speculation import Speculation
from .thinking_budget import force

if TYPE_CHECKING:
    from .drafting import Drafting
    from .state import BatchState

__all__ = ["Decoder", "Forward", "Stepped", "first_tokens"]


class Forward(NamedTuple):
    """A step's forward pass, penalized, not yet masked or sampled."""

    rows: list[Row]
    logits: mx.array
    ahead: list[int]  # see :func:`.sampling.draw`
    counts: list[mx.array | None]  # the rows' penalty counts before it


class Stepped(NamedTuple):
    """What one step strategy did, for its batch to apply and count.

    Attributes:
        read: The rows that got tokens (their rows' ``pending``).
        width: Rows in the step's forward pass (0: none ran).
        drafted: Draft tokens verified; ``accepted``: those kept.
    """

    read: list[Row]
    tokens: int
    width: int
    drafted: int = 0
    accepted: int = 0
    speculative: bool = False


def first_tokens(rows: list[Row], group: Prefilled) -> None:
    """Give the rows their first tokens from their prefill's logits, where it
    kept them (else their first decode step samples them)."""
    logits = group.logits
    if logits is None:
        return
    logits = penalize(logits, rows)
    logits = constrain(logits, [row.matcher for row in rows])
    logits = force(logits, rows)
    logits = ban_words(logits, rows)
    bias = bias_rows(rows, logits)
    states = [c.state for c in group.cache]
    firsts = collect(draw(logits, rows, bias, states))
    read(rows, [[first] for first in firsts])


class Decoder:
    """The step in flight of one batch, and its strategies.

    Attributes:
        speculation: The grammar speculation policy; None off the CPU backend.
        inflight: The step started and not yet read: its rows and its draw.
        hidden: The rows of the last forward pass and its last-layer output
            (B, 1, H) at their last token, kept while a native drafter
            drafts from it (:mod:`.native_drafter`)."""

    def __init__(self) -> None:
        self.speculation = Speculation() if mx.default_device() == mx.cpu else None
        self.inflight: tuple[list[Row], Draw] | None = None
        self._bias: mx.array | None = None  # (B, V), None when no row biases
        self.bias_stale = True
        self.drafting: Drafting | None = None
        self.hidden: tuple[list[Row], mx.array] | None = None

    def reading(self) -> list[Row]:
        return [] if self.inflight is None else self.inflight[0]

    def launch(self, batch: BatchState) -> int:
        """Build a step on the rows' last tokens and start it; its width (0: no
        row)."""
        forward = self._forward(batch, None)
        if forward is None:
            return 0
        return self._sample(batch, forward)

    def drain(self) -> Stepped:
        assert self.inflight is not None, "no step in flight"
        (rows, pending), self.inflight = self.inflight, None
        rows_read, tokens = read(rows, [[s] for s in collect(pending)])
        return Stepped(rows_read, tokens, 0)

    def pipelined(self, batch: BatchState) -> Stepped:
        """The step in flight read, the next one started on its tokens first (so it
        computes while the thread hands out tokens). A row that ends on a token
        read here had its next token computed for nothing."""
        assert self.inflight is not None, "no step in flight"
        if any(row.constrained() for row in batch.rows):
            return self._constrained_step(batch)
        (rows, pending), self.inflight = self.inflight, None
        forward = self._forward(batch, (rows, pending))
        width = 0 if forward is None else self._sample(batch, forward)
        rows_read, tokens = read(rows, [[s] for s in collect(pending)])
        return Stepped(rows_read, tokens, width)

    def _constrained_step(self, batch: BatchState) -> Stepped:
        """The step of a batch with a constrained row, whose mask needs this step's
        tokens: the next pass starts on them unread, they are read and checked
        while it computes, then its logits are masked and sampled."""
        assert self.inflight is not None
        (rows, pending), self.inflight = self.inflight, None
        speculation = self.speculation
        forward = self._forward(batch, (rows, pending), start=True)
        sampled = collect(pending)
        consumed: set[Row] = set()
        refused: set[Row] = set()
        if speculation is not None:
            consumed, refused = speculation.check(rows, pending, sampled)
        # Only a pass that holds a refused row's token is wrong.
        wrong = forward is not None and not refused.isdisjoint(forward.rows)
        if speculation is not None and pending.speculative:
            speculation.built(wrong)
        rows_read, tokens = read(rows, [[s] for s in sampled], consumed)
        if wrong and forward is not None and speculation is not None:
            again = functools.partial(self._forward, batch, None, start=True)
            forward = speculation.rebuild(forward, batch.cache or (), again)
        width = 0 if forward is None else self._sample(batch, forward, after_read=True)
        return Stepped(rows_read, tokens, width)

    def _forward(
        self,
        batch: BatchState,
        inflight: tuple[list[Row], Draw] | None,
        *,
        start: bool = False,
    ) -> Forward | None:
        """The next step's forward pass, penalized (with ``start``, started), on the
        tokens of the step ``inflight`` where there is one; None without rows."""
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
        # Only while the batch may draft: a larger one keeps nothing extra.
        keeping = self.drafting
        if keeping is not None and not (
            keeping.wants_hidden and keeping.policy.admits(len(rows))
        ):
            keeping = None
        if keeping is not None:
            kwargs.update(keeping.hidden_kwargs())
        output = batch.lm(inputs[:, None], cache=batch.cache, **kwargs)
        if keeping is not None:
            keeping.keep(self, rows, output.hidden_states)
        logits = penalize(output.logits[:, -1, :], rows, inputs, counted)
        if start:
            mx.async_eval(logits, *(c.state for c in batch.cache or ()))  # type: ignore[no-untyped-call]
        return Forward(rows, logits, ahead, counts)

    def _sample(
        self, batch: BatchState, forward: Forward, *, after_read: bool = False
    ) -> int:
        """Mask, bias and sample a forward pass's logits, and start it; its width.
        ``after_read``: the step before was read since."""
        rows = forward.rows
        speculation = self.speculation
        speculative: list[int] = []
        if after_read and speculation is not None:
            speculative = speculation.pick(rows, batch.cache or ())
        # A row that ended in the step read since has no next token to mask.
        matchers = [
            None if row.done or i in speculative else row.matcher
            for i, row in enumerate(rows)
        ]
        logits = constrain(forward.logits, matchers)
        # The rows' budgets are current: a step built before its rows' last
        # tokens are read has no row still thinking (see Row.constrained).
        logits = force(logits, rows)
        logits = ban_words(logits, rows)
        bias = self._bias_matrix(rows, logits)
        states = [c.state for c in batch.cache or ()]
        ahead = () if after_read else forward.ahead
        pending = draw(logits, rows, bias, states, ahead, speculative)
        self.inflight = (rows, pending)
        return len(rows)

    def _bias_matrix(self, rows: list[Row], logits: mx.array) -> mx.array | None:
        """:func:`.logits.bias_rows`, kept until the batch's rows change."""
        if self.bias_stale:
            self.bias_stale = False
            self._bias = bias_rows(rows, logits)
        return self._bias
