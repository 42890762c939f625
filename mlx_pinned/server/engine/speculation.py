"""Grammar speculation: a grammar row drawn without its mask and its token
checked by its matcher once read (:func:`.logits.speculates`); where the
grammar refuses it, the row is drawn again with the mask and the next pass
built again. Only on the CPU backend, where the masks compete with the
forward pass for the cores. MLX thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .logits import fill_masks, mask, speculates
from .quirks import cut_back_caches
from .rows import Row
from .sampling import Draw, Sampled, collect, draw

if TYPE_CHECKING:
    from .decode import Forward

__all__ = [
    "SPECULATION_MISSES",
    "SPECULATION_PAUSE",
    "SPECULATION_WINDOW",
    "Speculation",
]

# Grammar rows stop speculating for a while when more than SPECULATION_MISSES
# of the batch's last SPECULATION_WINDOW speculative steps were built again.
SPECULATION_WINDOW = 16
SPECULATION_MISSES = 4
SPECULATION_PAUSE = 64


class Speculation:
    """When grammar rows draw unmasked, and how a refusal is put right.
    ``window``: whether each recent speculative step was built again."""

    def __init__(self) -> None:
        self.window: collections.deque[bool] = collections.deque(
            maxlen=SPECULATION_WINDOW
        )
        self.paused = 0

    def pick(self, rows: Sequence[Row], caches: Sequence[Any]) -> list[int]:
        """The rows of a step built on read tokens to draw without their grammar's
        mask: those that can (:func:`.logits.speculates`) and whose grammar
        neither forces the next token nor may end here, while every cache can
        be cut back a token. A refusal costs a forward pass: after more than
        :data:`SPECULATION_MISSES` in the last :data:`SPECULATION_WINDOW` steps,
        every row is masked for :data:`SPECULATION_PAUSE` steps (a decision of
        the tokens alone, so every rank of a sharded model makes it alike)."""
        if not cut_back_caches(caches):
            return []
        if sum(self.window) > SPECULATION_MISSES:
            self.window.clear()
            self.paused = SPECULATION_PAUSE
        if self.paused:
            self.paused -= 1
            return []
        return [
            i
            for i, row in enumerate(rows)
            if speculates(row)
            and not row.done
            and row.matcher is not None
            and not row.matcher.forced()
        ]

    def check(
        self,
        rows: list[Row],
        pending: Draw,
        sampled: list[Sampled],
    ) -> tuple[set[Row], set[Row]]:
        """Check the tokens of the rows drawn unmasked: an allowed one is consumed
        by its matcher, a refused one drawn again with the mask and the same key
        (in ``sampled``). The rows consumed, and those refused."""
        consumed: set[Row] = set()
        refused: list[int] = []
        for i in pending.speculative:
            row = rows[i]
            if row.gone or row.done or row.matcher is None:
                continue  # not read (see Decoder.read)
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
            redrawn = collect(draw(logits, again, bias))
            for i, item in zip(refused, redrawn, strict=True):
                sampled[i] = item
        return consumed, {rows[i] for i in refused}

    def built(self, wrong: bool) -> None:
        self.window.append(wrong)

    def rebuild(
        self,
        forward: Forward,
        caches: Sequence[Any],
        again: Callable[[], Forward | None],
    ) -> Forward | None:
        """The next forward pass built again (``again``) on the step's tokens as
        read: its cache entries cut off and the penalties' counts put back."""
        for c in caches:
            c.trim(1)
        for row, counts in zip(forward.rows, forward.counts, strict=True):
            row.counts = counts
        return again()
