"""The admission gate: at most ``max_num_seqs`` generations at once.

Event loop only (asyncio or trio, through anyio); never touches MLX.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.lowlevel import RunVar

from ..failures import OverloadedError

__all__ = ["BatchGate"]


class BatchGate:
    """At most ``max_num_seqs`` generations at once; the rest wait their turn.

    Event-loop side (asyncio or trio, through anyio). Waiting requests are
    admitted in arrival order as slots free up; at most ``max_pending`` may
    wait, past that :meth:`turn` refuses at once. A slot is given back
    when the ``turn()`` block exits, so close the stream inside it.

    Args:
        max_num_seqs: Generations active at once (the decode batch bound).
        max_pending: Requests that may wait for a slot.
        retry_after: Seconds a refused request is told to wait.
    """

    def __init__(
        self, max_num_seqs: int, max_pending: int, *, retry_after: int = 1
    ) -> None:
        if max_num_seqs < 1 or max_pending < 0:
            raise ValueError(
                "max_num_seqs must be >= 1 and max_pending >= 0, not "
                f"{max_num_seqs} and {max_pending}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_pending = max_pending
        self.retry_after = retry_after
        self.waiting = 0  # requests waiting for a slot
        self.active = 0  # requests holding a slot
        # One semaphore per event loop: a gate used again under another loop
        # (or backend) must not wait on the first one's.
        self._slots: RunVar[anyio.Semaphore] = RunVar("mlx_pinned_batch_gate")

    @property
    def busy(self) -> bool:
        """Whether any generation holds a slot."""
        return self.active > 0

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold a slot for the block; refused at once when the waiting room is
        full.

        Cancelling the caller while it waits gives up its place: its
        generation never starts.

        Raises:
            OverloadedError: ``max_pending`` requests wait already.
        """
        try:
            slots = self._slots.get()
        except LookupError:  # the first turn on this event loop
            slots = anyio.Semaphore(self.max_num_seqs)
            self._slots.set(slots)
        # Who waits, as the semaphore counts it: a slot being handed to a
        # waiter leaves the room at once, before that waiter runs again (the
        # gate's own count lags until then).
        queued = slots.statistics().tasks_waiting
        if slots.value == 0 and queued >= self.max_pending:
            raise OverloadedError(queued, retry_after=self.retry_after)
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            slots.release()
