"""A row's thinking budget (vLLM's ``thinking_token_budget``): after
``budget`` reasoning tokens, the closing marker is forced a token a step,
then the row samples freely again. A row that closes its reasoning itself,
or does not open it with its first tokens, is never forced. MLX thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

__all__ = ["ThinkingBudget", "force"]


class _Phase(enum.Enum):
    BEFORE = "before"  # the reasoning has not opened yet
    THINKING = "thinking"
    FORCING = "forcing"  # writing the closing marker
    AFTER = "after"  # closed: nothing more to do


class ThinkingBudget:
    """One row's budget and where its reasoning stands. ``opening``: empty when
    the prompt opened the reasoning; ``closing``: not empty."""

    def __init__(
        self, budget: int, opening: Sequence[int], closing: Sequence[int]
    ) -> None:
        self.budget = budget
        self.opening = tuple(opening)
        self.closing = tuple(closing)
        self.thought = 0  # reasoning tokens so far
        self._forced = 0  # closing tokens forced so far
        self._seen = 0  # tokens read before the reasoning opened
        self._tail: list[int] = []  # the last tokens, to find a marker in
        self._phase = _Phase.THINKING if not self.opening else _Phase.BEFORE

    @property
    def open(self) -> bool:
        """Whether a token can still be forced."""
        return self._phase is not _Phase.AFTER

    def next_forced(self) -> int | None:
        """The token the next step must sample, if any."""
        if self._phase is _Phase.THINKING and self.thought >= self.budget:
            self._phase = _Phase.FORCING
        if self._phase is _Phase.FORCING:
            return self.closing[self._forced]
        return None

    def observe(self, token: int) -> None:
        phase = self._phase
        if phase is _Phase.FORCING:
            self._forced += 1
            if self._forced == len(self.closing):
                self._phase = _Phase.AFTER
            return
        if phase is _Phase.AFTER:
            return
        self._tail = [*self._tail, token][-max(len(self.opening), len(self.closing)) :]
        if phase is _Phase.BEFORE:
            self._seen += 1
            if tuple(self._tail) != self.opening[: self._seen]:
                self._phase = _Phase.AFTER  # the answer did not open with it
            elif self._seen == len(self.opening):
                self._phase, self._tail = _Phase.THINKING, []
            return
        if self._ends(self.closing):
            self._phase = _Phase.AFTER  # closed by the model itself
            return
        self.thought += 1

    def _ends(self, marker: tuple[int, ...]) -> bool:
        return (
            len(self._tail) >= len(marker)
            and tuple(self._tail[-len(marker) :]) == marker
        )


class Budgeted(Protocol):
    thinking: ThinkingBudget | None
    done: bool


def force(logits: mx.array, rows: Sequence[Budgeted]) -> mx.array:
    """``logits`` (B, V) with every token but the forced one at -inf, in the
    rows a budget forces now; the others keep theirs exactly."""
    forced = [
        None if row.done or row.thinking is None else row.thinking.next_forced()
        for row in rows
    ]
    if all(token is None for token in forced):
        return logits
    vocab = logits.shape[-1]
    targets = mx.array([-1 if t is None else t for t in forced], dtype=mx.int32)
    keep = (mx.arange(vocab)[None, :] == targets[:, None]) | (targets < 0)[:, None]
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))
