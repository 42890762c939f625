"""How many tokens of a long prompt to prefill in one chunk: by time
(docs/engine.md, "A long prompt's chunks, by time"), so the rows that
decode meanwhile pause about the same whatever the model. MLX thread only.
"""

from __future__ import annotations

__all__ = ["PrefillPacer"]

# The fewest tokens a paced chunk has: below it, a pass costs more for its
# own overhead than its tokens save.
MIN_CHUNK = 64
#: While nobody waits on a chunk, it takes this many times the budget: a
#: prompt that arrives meanwhile waits at most that long for its turn.
IDLE = 2


class PrefillPacer:
    """The token count of the next chunk of a long prompt's prefill.

    Args:
        budget: Seconds a chunk should take while rows decode; None: every
            chunk is ``cap`` tokens.
        cap: The most tokens a chunk has (``--prefill-step-size``).
    """

    def __init__(self, budget: float | None, cap: int) -> None:
        self.budget = budget
        self.cap = cap
        # Seconds per token of the last chunk, None before the first: that
        # one is MIN_CHUNK tokens while rows decode, to learn the model.
        self.per_token: float | None = None

    def tokens(self, *, decoding: bool) -> int:
        """The next chunk's size; ``decoding``: whether rows (or a prompt that
        ends in the step) wait on it, else it takes :data:`IDLE` budgets."""
        if self.budget is None:
            return self.cap
        if self.per_token is None:
            return min(self.cap, MIN_CHUNK)
        seconds = self.budget * (1 if decoding else IDLE)
        return max(MIN_CHUNK, min(self.cap, int(seconds / self.per_token)))

    def spent(self, seconds: float) -> bool:
        """Whether a step's prefill that took ``seconds`` is all it may have while
        something waits on it."""
        return self.budget is not None and seconds >= self.budget

    def observe(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` took ``seconds``: the next is sized by it (the cost
        per token only grows along a prompt)."""
        if tokens > 0 and seconds > 0:
            self.per_token = seconds / tokens
