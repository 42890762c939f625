"""Each request's output on the event loop: what the loop's driver
(:mod:`.driver`) puts in, and the stream its reader takes it from.

Event loop only; no MLX. A :class:`RowOutput` holds one request's items on
their way from the driver to its reader; a :class:`RowStream` is what the
request's :class:`~..events.EventStream` reads: an event at a time, in
batches, whole for an answer sent whole, or as they flow for a streamed one.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

import anyio

from ..events import Event, FinalEvent

if TYPE_CHECKING:
    from .answers import Item, Request
    from .driver import LoopDriver

__all__ = ["RowOutput", "RowStream"]

# As many events as there are: what a flowing or whole reader takes.
_ALL = 1 << 30


class RowOutput:
    """One request's items on their way from the driver to its reader.

    Event loop only. The reader wakes when as many items as it asked for
    are in, or the answer ended (a :class:`~..events.FinalEvent` or an
    error is in).
    """

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._ended = False
        self._want = 1
        self._ready: anyio.Event | None = None
        self._gone: anyio.Event | None = None
        self.gone = False  # the loop holds no row of it

    def put(self, items: tuple[Item, ...], *, gone: bool) -> None:
        """Add a turn's items (the driver)."""
        self._items.extend(items)
        if any(isinstance(i, (FinalEvent, BaseException)) for i in items):
            self._ended = True
        if gone:
            self.gone = self._ended = True
            if self._gone is not None:
                self._gone.set()
        ready = self._ready
        if ready is not None and (self._ended or len(self._items) >= self._want):
            self._ready = None
            ready.set()

    async def take(self, n: int, least: int | None = None) -> tuple[Event, ...]:
        """Up to ``n`` events, once ``least`` (``n`` by default) are in or
        the answer ended; ``()`` after the end. An error is raised once the
        events before it are taken."""
        least = n if least is None else least
        while len(self._items) < least and not self._ended:
            self._want = least
            self._ready = ready = anyio.Event()
            await ready.wait()
        taken: list[Event] = []
        while self._items and len(taken) < n:
            item = self._items[0]
            if isinstance(item, BaseException):
                if taken:
                    break
                self._items.popleft()
                raise item
            taken.append(item)
            self._items.popleft()
        return tuple(taken)

    async def wait_gone(self) -> None:
        """Until the loop holds no row of it."""
        if not self.gone:
            self._gone = gone = anyio.Event()
            await gone.wait()


class RowStream:
    """What a request's :class:`~..events.EventStream` reads: its row's
    output; closing it (or cancelling its reader, or dropping it) takes the
    row out at the loop's next turn. Event loop only."""

    def __init__(self, loop: LoopDriver, request: Request) -> None:
        assert request.output is not None
        self._loop = loop
        self._request = request
        self._output = request.output
        self._finalizer = weakref.finalize(self, loop.close, request)

    def __aiter__(self) -> RowStream:
        return self

    async def __anext__(self) -> Event:
        events = await self._take(1)
        if not events:
            raise StopAsyncIteration
        return events[0]

    def batched(self, n: int | None) -> AsyncIterator[tuple[Event, ...]]:
        """The events in tuples of up to ``n``, one wake-up per tuple; None:
        every event in one tuple, once the answer ended."""
        if n is None:
            self._loop.whole(self._request)
            return self._batches(_ALL)
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        return self._batches(n)

    async def _batches(self, n: int) -> AsyncIterator[tuple[Event, ...]]:
        while events := await self._take(n):
            yield events

    def flowing(self, interval: float) -> AsyncGenerator[tuple[Event, ...], None]:
        """The events as they come, every one that is in at each wake-up,
        and at most one wake-up each ``interval`` seconds (but the first:
        an answer's first token goes out as soon as it is in)."""
        if interval < 0:
            raise ValueError(f"interval must be 0 or more, not {interval}")
        return self._flow(interval)

    async def _flow(self, interval: float) -> AsyncGenerator[tuple[Event, ...], None]:
        # A plain sleep: a cancel scope to wake at the end as well costs the
        # event loop more per write than the write itself (measured).
        due = 0.0
        while True:
            wait = due - time.monotonic()
            if wait > 0:
                await anyio.sleep(wait)
            events = await self._take(_ALL, least=1)
            if not events:
                return
            yield events
            due = time.monotonic() + interval

    async def _take(self, n: int, least: int | None = None) -> tuple[Event, ...]:
        try:
            return await self._output.take(n, least)
        except BaseException:
            self._loop.close(self._request)  # cancelled, or its error
            raise

    async def aclose(self) -> None:
        """Take the row out, and wait until the loop did."""
        self._finalizer.detach()
        if self._loop.close(self._request):
            await self._output.wait_gone()
