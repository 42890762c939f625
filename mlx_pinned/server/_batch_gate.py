"""Event-loop side of batching: the admission gate and the event stream.

:class:`BatchGate` bounds the active sequences (``max_num_seqs``) and keeps
the rest waiting, in order, in a bounded room; :class:`BatchStream` is what
:func:`.batching.iterate` returns. Both run on the event loop (asyncio or
trio, through anyio); neither touches MLX.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.lowlevel import RunVar

from .engine import FinalEvent, TokenEvent
from .schemas import APIError

__all__ = ["ADMITTED", "Admitted", "BatchGate", "BatchStream"]

Event = TokenEvent | FinalEvent


class Admitted:
    """The first item of an announced generation: its prompt is queued."""


ADMITTED = Admitted()


class BatchStream:
    """The events of one batched generation (see :func:`iterate`); event loop."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __aiter__(self) -> BatchStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            item = await self._inner.__anext__()
            if not isinstance(item, Admitted):
                event: Event = item
                return event

    def batched(self, n: int) -> _Batches:
        """The events in tuples of up to ``n``, one wake-up per tuple (see
        ``AsyncStreamIterator.batched``); ``aclose()`` still closes the
        generation."""
        return _Batches(self._inner.batched(n))

    async def aclose(self) -> None:
        """Close the generation on the thread and wait until it is closed."""
        await self._inner.aclose()

    async def __aenter__(self) -> BatchStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Batches:
    """The batches of a :class:`BatchStream`, without the admission marker."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __aiter__(self) -> _Batches:
        return self

    async def __anext__(self) -> tuple[Event, ...]:
        while True:
            batch = await self._inner.__anext__()
            events = tuple(e for e in batch if not isinstance(e, Admitted))
            if events:
                return events


class BatchGate:
    """At most ``max_num_seqs`` generations at once; the rest wait their turn.

    Event-loop side (asyncio or trio, through anyio). Waiting requests are
    admitted in arrival order as slots free up; at most ``max_pending`` may
    wait, past that :meth:`turn` answers 503 at once. A slot is given back
    when the ``turn()`` block exits, so close the stream inside it.

    Args:
        max_num_seqs: Generations active at once (the decode batch bound).
        max_pending: Requests that may wait for a slot.
    """

    def __init__(self, max_num_seqs: int, max_pending: int) -> None:
        if max_num_seqs < 1 or max_pending < 0:
            raise ValueError(
                "max_num_seqs must be >= 1 and max_pending >= 0, not "
                f"{max_num_seqs} and {max_pending}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_pending = max_pending
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
        """Hold a slot for the block; 503 at once when the waiting room is full.

        Cancelling the caller while it waits gives up its place: its
        generation never starts.

        Raises:
            APIError: 503 with ``Retry-After`` when ``max_pending`` wait already.
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
            raise APIError(
                503,
                f"The server is busy: {queued} requests are already waiting "
                "for the model; retry shortly.",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
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
