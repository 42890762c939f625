"""MLXThreadStatistics: a snapshot of an MLX thread's queue and counters.

:func:`take_statistics` runs on the caller's thread, any thread: it reads the
worker's counters without its lock and never stops the MLX thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._keys import user_key
from ._mlx import job_name

if TYPE_CHECKING:
    from ._worker import Worker


@dataclass(frozen=True)
class MLXThreadStatistics:
    """A snapshot of an :class:`MLXThread`'s queue and counters.

    Attributes:
        pending: jobs and streams queued and not started (what ``max_pending``
            bounds); the running job is not counted.
        running: name of the job running now, or ``None``.
        completed: jobs and streams that ended with a result.
        failed: jobs and streams that ended with an exception.
        cancelled: jobs and streams that never started or were closed early.
        busy_time: seconds the thread spent running jobs.
        open_streams: streams whose generator exists on the thread.
        max_pending: the queue bound, ``None`` for unbounded.
        waiting_for_key: ``(key, count)`` for each exclusive key that keyed
            jobs and streams are waiting for (another holder of the key is
            open); they are counted in ``pending`` too.
    """

    pending: int
    running: str | None
    completed: int
    failed: int
    cancelled: int
    busy_time: float
    open_streams: int
    max_pending: int | None
    waiting_for_key: tuple[tuple[object, int], ...] = field(default=())


def take_statistics(worker: Worker, max_pending: int | None) -> MLXThreadStatistics:
    """The snapshot of ``worker``'s counters, for ``MLXThread.statistics()``."""
    job, since = worker.running, worker.busy_since
    fn = None if job is None else job.fn
    busy = worker.busy_time + (0.0 if since is None else time.perf_counter() - since)
    return MLXThreadStatistics(
        pending=max(0, worker.pending()),
        running=None if fn is None else job_name(fn),
        completed=worker.completed_count,
        failed=worker.failed_count,
        cancelled=worker.cancelled_count + worker.discarded_count,
        busy_time=busy,
        open_streams=len(worker.open_streams),
        max_pending=max_pending,
        # list(): one step that another thread cannot interleave with.
        waiting_for_key=tuple(
            (user_key(key), len(waiting))
            for key, waiting in list(worker.waiting.items())
            if waiting
        ),
    )
