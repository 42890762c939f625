"""When a batch's step speculates and how many tokens each row drafts: one
policy for every source of drafts (prompt lookup, a prediction, a draft
model, a native drafter), from the batch's size and each row's running
share of drafts kept. MLX thread only; docs/engine.md has the figures its
values come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from .rows import Row

__all__ = [
    "COSTLY_RESTS",
    "FLOOR",
    "MODEL_FLOOR",
    "MOST_REST",
    "REST",
    "DraftPolicy",
    "pace",
    "resting",
]

# A row's running share of drafts kept under which it rests. Drafts that
# cost nothing to make (prompt lookup, a prediction) pay from about a tenth
# kept, what a verify pass at one row costs. A model's drafts cost its
# forward passes: on the CPU backend, where a pass costs in proportion to
# its tokens, they pay only when nearly all are kept; elsewhere a pass is
# bound by memory bandwidth and they pay from well under half.
FLOOR = 0.1
MODEL_FLOOR = 0.9 if mx.default_device() == mx.cpu else 0.3
# A resting row's first and longest rests, in tokens; a model's drafts rest
# COSTLY_RESTS times as long (each try costs a step of drafting).
REST = 8
MOST_REST = 128
COSTLY_RESTS = 4


def resting(row: Row) -> bool:
    """Whether a row drafts nothing now: its drafts were not being kept."""
    return row.sampled < row.rests_until


def pace(
    row: Row, drafted: int, kept: int, floor: float | None = None, scale: int = 1
) -> None:
    """Count a speculative step in a row's running acceptance; under
    ``floor`` (:data:`FLOOR` when None) it rests, twice as long as the last
    time, ``scale`` times :data:`REST` at first and :data:`MOST_REST` at most."""
    if not drafted:
        return
    row.acceptance = (3 * row.acceptance + kept / drafted) / 4
    if row.acceptance >= (FLOOR if floor is None else floor):
        row.rest = 0
        return
    row.rest = min(scale * MOST_REST, max(scale * REST, 2 * row.rest))
    row.rests_until = row.sampled + row.rest


@dataclass(frozen=True)
class DraftPolicy:
    """The policy of one batch's drafts.

    Attributes:
        tokens: Draft tokens per row and step, at most.
        max_batch: Speculate only while the batch holds at most this many
            rows, those joining it counted (0: at any size): a verify pass
            computes every row's drafts, and past a few rows on the CPU
            backend that costs the batch more than the drafts give.
        costly: The drafts cost forward passes of a model, the most any row
            drafts: a row drafts in proportion to its running acceptance,
            and rests under :data:`MODEL_FLOOR` rather than :data:`FLOOR`.
    """

    tokens: int
    max_batch: int = 0
    costly: bool = False

    @property
    def floor(self) -> float:
        return MODEL_FLOOR if self.costly else FLOOR

    def admits(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows may speculate."""
        return not self.max_batch or rows <= self.max_batch

    def count(self, row: Row, most: int | None = None) -> int:
        """Tokens ``row`` drafts this step, at most ``most`` (its tokens left
        but one): none while it rests."""
        if resting(row):
            return 0
        count = self.tokens if most is None else min(self.tokens, most)
        if self.costly:
            count = min(count, max(1, round(row.acceptance * self.tokens)))
        return max(0, count)

    def pace(self, row: Row, drafted: int, kept: int) -> None:
        pace(row, drafted, kept, self.floor, COSTLY_RESTS if self.costly else 1)
