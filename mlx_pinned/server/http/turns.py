"""Fair turns on the event loop for requests that are ready together.

Event loop only (asyncio, uvloop included; elsewhere a no-op).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import sniffio

__all__ = ["LoopTurns"]


class LoopTurns:
    """Share the event loop fairly when many requests are ready at once.

    asyncio runs every callback that was ready when an iteration began before
    it polls its sockets again, so many streams ending together would make
    every other request wait for all their Python. A request that calls
    :meth:`checkpoint` between its pieces of work yields once the loop's
    current busy stretch has run longer than ``budget`` seconds; the stretch
    ends when a marker callback runs, after the next poll. Waiters go in
    order: a request over the budget, or arriving while others wait, joins
    the line, and the first in line goes on once a new stretch has room. A
    lone stream never yields.
    """

    def __init__(self, budget: float = 0.0005) -> None:
        self.budget = budget
        self.yields = 0  # how often a checkpoint gave the loop away
        self._since = 0.0  # start of the current busy stretch
        # The loop whose stretch is open (its marker has not run yet); a
        # loop that closed with its marker pending leaves it here, so the
        # check is "is it this loop", never "is one open".
        self._marked: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the line's loop
        self._line: deque[asyncio.Future[None]] = deque()  # who waits, in order

    async def checkpoint(self) -> None:
        """Yield to the event loop if this stretch has used up its budget, or
        if others already wait for their turn (they go first)."""
        loop = asyncio._get_running_loop()
        if loop is None:  # trio, or no event loop
            return
        if self._marked is not loop:
            if sniffio.current_async_library() != "asyncio":
                return
            if self._loop is not loop:  # first use, or another loop: afresh
                self._loop, self._line = loop, deque()
            self._open(loop)
            if not self._line:
                return
        elif not self._line and time.perf_counter() - self._since <= self.budget:
            return
        # Wait in line: behind the others, then (first in line) for a
        # stretch with room. Only the first in line re-checks each loop
        # iteration; the others wait for their turn without waking.
        line = self._line
        turn = loop.create_future()
        line.append(turn)
        try:
            if len(line) > 1:
                self.yields += 1
                await turn
            while True:
                if self._marked is not loop:
                    self._open(loop)
                    return
                if time.perf_counter() - self._since <= self.budget:
                    return
                self.yields += 1
                await asyncio.sleep(0)
        finally:
            if line[0] is turn:  # the next one is first in line now
                line.popleft()
                if line and not line[0].done():
                    line[0].set_result(None)
            else:  # cancelled while waiting behind others
                line.remove(turn)

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._marked = loop
        self._since = time.perf_counter()
        loop.call_soon(self._unmark, loop)

    def _unmark(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._marked is loop:
            self._marked = None
