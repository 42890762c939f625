"""What one model's batch has done: counted on the MLX thread (:class:`Tally`)
and read from any thread as a frozen :class:`BatchStatistics`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchStatistics", "Tally"]


@dataclass(frozen=True)
class BatchStatistics:
    """A snapshot of one model's batch.

    Attributes:
        active: Rows in the decode batch now.
        joining: Rows queued, being prefilled, or waiting to join.
        peak_active: Most rows ever decoded in one step.
        decoded_tokens: Tokens sampled by decode steps (not prefill's).
        prefill_passes: Prefill passes run: prompts queued together share one.
        speculative_steps: Decode steps that verified drafts.
        speculative_rows: Rows of those steps, summed over the steps.
        draft_tokens: Draft tokens those steps verified.
        accepted_tokens: Draft tokens they kept.
    """

    active: int
    joining: int
    peak_active: int
    steps: int
    decoded_tokens: int
    prefills: int
    prefill_passes: int
    prefill_seconds: float
    step_seconds: float
    speculative_steps: int = 0
    speculative_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Tally:
    """The batch's running counts, named as in :class:`BatchStatistics`."""

    peak_active: int = 0
    steps: int = 0
    decoded_tokens: int = 0
    prefills: int = 0
    prefill_passes: int = 0
    prefill_seconds: float = 0.0
    step_seconds: float = 0.0
    speculative_steps: int = 0
    speculative_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def snapshot(self, active: int, joining: int) -> BatchStatistics:
        """The counts with the rows decoding and joining now; any thread."""
        return BatchStatistics(active=active, joining=joining, **vars(self))
