"""What a failed step does (docs/engine.md, "When a step fails"): the rows
the failing stage touched end with :class:`StepFailedError`, the failure is
logged once at ERROR, and the batch's other rows go on. MLX thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..failures import UnavailableError

if TYPE_CHECKING:
    from .rows import Row
    from .state import BatchState

__all__ = ["StepFailedError", "end_rows", "fail_all", "fail_batch"]

logger = logging.getLogger("mlx_pinned.server")


class StepFailedError(UnavailableError):
    """A step failed while it held the request's row; the server's log says
    why (and ``__cause__`` is the failure). The request may be sent again."""

    def __init__(self, stage: str) -> None:
        super().__init__(
            f"The server failed in the {stage} of this answer's step (its log "
            "says why); send the request again.",
            "generation_failed",
            retry_after=1,
        )
        self.stage = stage


def end_rows(rows: Sequence[Row], stage: str, exc: Exception) -> StepFailedError:
    """End ``rows``, those a failure ``exc`` in a step's ``stage`` touched, with
    a :class:`StepFailedError`, and log the failure once."""
    error = StepFailedError(stage)
    error.__cause__ = exc
    for row in rows:
        row.error, row.done = error, True
    logger.error(
        "a batch step failed in its %s, %d rows end with an error: %r",
        stage,
        len(rows),
        exc,
        exc_info=exc,
    )
    return error


def fail_batch(state: BatchState, exc: Exception, reading: Sequence[Row]) -> None:
    """A failure in ``state.stage`` of a step, where the batch's cache is used:
    the batch's rows and those of the step being read (``reading``) end; the
    rows yet to join go on, into a new batch."""
    touched = dict.fromkeys(r for r in (*state.rows, *reading) if not r.done)
    end_rows([row for row in touched if not row.gone], state.stage, exc)
    _empty(state)


def fail_all(
    state: BatchState, exc: BaseException, reading: Sequence[Row] = ()
) -> None:
    """End every row of ``state`` with ``exc``, and those of the step being read
    (``reading``) that are not done."""
    held = [row for rows, _ in state.joining for row in rows]
    held += state.prefills.clear()
    unread = [row for row in reading if not row.done]
    for row in (*state.rows, *held, *unread):
        row.error, row.done = exc, True
    state.joining = []
    _empty(state)


def _empty(state: BatchState) -> None:
    state.rows, state.cache, state.deltas = [], None, None
    state.decoder.inflight = None
    state.leaving.clear()
    state.decoder.bias_stale = True
