"""The admission gate: at most ``max_num_seqs`` generations at once.

Event loop only (asyncio or trio, through anyio); never touches MLX.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from anyio.lowlevel import (
    RunVar,
    cancel_shielded_checkpoint,
    checkpoint_if_cancelled,
)

from ..failures import OverloadedError

__all__ = ["BatchGate"]


@dataclass(order=True)
class _Waiter:
    """A request waiting for a slot; waiters order by priority, then arrival."""

    priority: int
    arrival: int
    ready: anyio.Event = field(compare=False, default_factory=anyio.Event)
    handed: bool = field(compare=False, default=False)  # a slot is its own


class _Slots:
    """One event loop's free slots and its waiting room (a heap)."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.room: list[_Waiter] = []
        self._arrivals = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self.free > 0:  # nobody waits while a slot is free
            await checkpoint_if_cancelled()
            self.free -= 1
            await cancel_shielded_checkpoint()
            return
        waiter = _Waiter(priority, next(self._arrivals))
        heapq.heappush(self.room, waiter)
        try:
            await waiter.ready.wait()
        except BaseException:
            if waiter.handed:  # given a slot as it was cancelled: pass it on
                self.release()
            else:
                self.room.remove(waiter)
                heapq.heapify(self.room)
            raise

    def release(self) -> None:
        """Hand the slot to the first waiter, else free it."""
        if self.room:
            waiter = heapq.heappop(self.room)
            waiter.handed = True
            waiter.ready.set()
        else:
            self.free += 1


class BatchGate:
    """At most ``max_num_seqs`` generations at once; the rest wait their turn.

    Event-loop side (asyncio or trio, through anyio). Waiting requests are
    admitted as slots free up, the lowest ``priority`` first (vLLM's:
    lower is sooner) and in arrival order within one; at most
    ``max_pending`` may wait, past that :meth:`turn` refuses at once. A
    slot is given back when the ``turn()`` block exits, so close the stream
    inside it.

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
        self._slots: RunVar[_Slots] = RunVar("mlx_pinned_batch_gate")

    @property
    def busy(self) -> bool:
        """Whether any generation holds a slot."""
        return self.active > 0

    @asynccontextmanager
    async def turn(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold a slot for the block; refused at once when the waiting room is
        full. ``priority``: lower is admitted sooner.

        Cancelling the caller while it waits gives up its place: its
        generation never starts.

        Raises:
            OverloadedError: ``max_pending`` requests wait already.
        """
        try:
            slots = self._slots.get()
        except LookupError:  # the first turn on this event loop
            slots = _Slots(self.max_num_seqs)
            self._slots.set(slots)
        # Who waits, as the room counts it: a slot being handed to a waiter
        # leaves the room at once, before that waiter runs again (the gate's
        # own count lags until then).
        queued = len(slots.room)
        if slots.free == 0 and queued >= self.max_pending:
            raise OverloadedError(queued, retry_after=self.retry_after)
        self.waiting += 1
        try:
            await slots.acquire(priority)
        finally:
            self.waiting -= 1
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            slots.release()
