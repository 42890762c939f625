"""The engine's event-loop side: the loop's driver and each request's output.

The one part of the engine that runs on the event loop (asyncio or trio,
through anyio); it touches no MLX. The loop (:mod:`.loop`) runs on the MLX
thread as one ``MLXThread.iterate`` stream; its driver, a task of the event
loop (:func:`spawn`), reads each turn's outputs and puts them in the
:class:`RowOutput` of each request, which the request's
:class:`~..events.EventStream` reads (:class:`RowStream`). A slow reader
never holds the loop: its events wait in its own output.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Sequence,
)
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from ..events import EventStream, GenerationParams
from .answers import Outputs, Request
from .outputs import RowOutput, RowStream

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread
    from mlx_pinned.types import AsyncStreamIterator

__all__ = ["LAZY_TURNS", "LoopDriver", "spawn"]


logger = logging.getLogger("mlx_pinned.server")

# Turns the loop may run ahead of a driver no eager reader waits on.
LAZY_TURNS = 1024

_tasks: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references


def spawn(fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Run ``fn(*args)`` as a task of the running event loop that outlives
    its caller (the loop's driver serves every request, not the one that
    started it). Event loop only."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn, *args)
        return
    task = asyncio.get_running_loop().create_task(fn(*args))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


class LoopDriver(abc.ABC):
    """The event-loop side of a model's loop (:class:`~.loop.BatchLoop`):
    requests submit and close here, and the driver task routes the loop's
    outputs. What both sides share is guarded by one lock.

    Args:
        thread: The MLX thread the loop runs on.
    """

    def __init__(self, thread: MLXThread) -> None:
        self.thread = thread
        # Reentrant: garbage collection can run while a thread holds it and
        # collect a request's stream, whose finalizer closes the request.
        self._lock = threading.RLock()
        # Under the lock: what requests asked for since the last turn, what
        # the last turns handed out to async requests, and those requests.
        self._admissions: list[Request] = []
        self._leaves: list[Request] = []
        self._outbox: Outputs = []
        self._live: set[Request] = set()
        self._items: AsyncStreamIterator[None] | None = None  # the loop's stream
        self._wake = 1  # turns that wake the driver
        self._scope: anyio.CancelScope | None = None  # the driver's wait
        self._stopping = False  # the driver closes the loop's stream
        self._running = False
        self._epoch = 0  # which run() is the loop's

    def queued(self) -> int:
        """Requests submitted and not yet admitted; any thread."""
        with self._lock:
            return len(self._admissions)

    @abc.abstractmethod
    def run(self, epoch: int) -> Generator[None, None, None]:
        """The loop, on the MLX thread (:meth:`.loop.BatchLoop.run`)."""

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> EventStream:
        """Submit a generation; its events. Event loop only: the loop is
        started here when it is not running (its driver is a task of this
        event loop).

        Raises:
            MLXThreadClosedError: The thread is closed (raised here, at once).
            MLXThreadBusyError: The thread's queue is full.
        """
        request = Request(params, images, RowOutput())
        with self._lock:
            self._admissions.append(request)
            self._live.add(request)
            if self._wake > 1 and self._items is not None:
                self._wake_at(1)  # it reads every event, until it says not
            start = not self._running
            if start:
                self._running = True
                self._epoch += 1
            epoch = self._epoch
        if start:
            try:
                items = self.thread.iterate(self.run, epoch)
            except BaseException:
                with self._lock:
                    self._admissions.remove(request)
                    self._live.discard(request)
                    self._running = False
                raise
            spawn(self._drive, items, epoch)
        return EventStream(RowStream(self, request))

    def close(self, request: Request, *, stop: bool = False) -> bool:
        """Take ``request``'s row out at the loop's next turn; any thread.
        Whether the loop holds it still (its output then says when it left).

        With ``stop`` (event loop only): if no other reader is left, the
        driver closes the loop's stream instead, and the loop takes the row
        out as it closes.
        """
        with self._lock:
            if request.ended:
                return False
            if request in self._admissions:
                self._admissions.remove(request)
                request.ended = True
                self._live.discard(request)
                return False
            if request not in self._leaves:
                self._leaves.append(request)
            leaving = set(self._leaves)
            last = not self._admissions and all(r in leaving for r in self._live)
            if stop and last and self._items is not None and not self._stopping:
                self._stopping = True
                if self._scope is not None:
                    self._scope.cancel()
            return True

    def _wake_at(self, size: int) -> AsyncIterator[tuple[None, ...]]:
        """Wake the driver once ``size`` turns are in (under the lock)."""
        assert self._items is not None
        self._wake = size
        return self._items.batched(size)

    def reading(self, request: Request, *, eager: bool) -> None:
        """Whether ``request``'s reader takes every event as it comes
        (``eager``) or its answer whole; event loop."""
        with self._lock:
            request.eager = eager
            if eager and self._wake > 1 and self._items is not None:
                self._wake_at(1)

    async def _drive(self, items: AsyncStreamIterator[None], epoch: int) -> None:
        """Route the loop's outputs to their requests until it ends (starting
        it again where its stream was closed with work left); if it breaks
        (the thread closed under it), fail every request."""
        error: BaseException | None = None
        try:
            while True:
                await self._follow(items)
                with self._lock:
                    more = self._running and self._epoch == epoch
                if not more:
                    return
                items = self.thread.iterate(self.run, epoch)
        except BaseException as exc:
            error = exc
            if not isinstance(exc, Exception):
                raise  # cancelled: the event loop is going away
            logger.debug("the batch's loop stopped", exc_info=True)
        finally:
            if error is not None:
                self._fail_live(error, epoch)

    async def _follow(self, items: AsyncStreamIterator[None]) -> None:
        """Route the outputs of one stream of the loop until it ends.

        The driver wakes at every turn while a reader takes every event;
        otherwise only once an answer ended (or every :data:`LAZY_TURNS`
        turns), so an answer read whole wakes the event loop once.
        """
        try:
            async with items:
                await self._wait_turns(items)
        finally:
            with self._lock:
                outputs, self._outbox = self._outbox, []
                if self._items is items:
                    self._items, self._wake, self._scope = None, 1, None
            self._route(outputs)

    async def _wait_turns(self, items: AsyncStreamIterator[None]) -> None:
        waits: AsyncIterator[Any] = items  # one turn a wake, two ahead
        with self._lock:
            self._items, self._wake = items, 1
        while True:
            with self._lock:
                outputs, self._outbox = self._outbox, []
                lazy = not any(r.eager for r in self._live)
                if lazy and self._wake == 1:
                    waits = self._wake_at(LAZY_TURNS)
                elif not lazy and self._wake > 1:
                    waits = self._wake_at(1)
            self._route(outputs)
            with anyio.CancelScope() as scope:
                with self._lock:
                    stopping = self._stopping
                    self._scope = None if stopping else scope
                if stopping:
                    await items.aclose()  # the loop takes the rows out as it closes
                    return
                try:
                    await waits.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    with self._lock:
                        self._scope = None
            if scope.cancelled_caught:  # the last reader left: it closes
                async for _ in waits:
                    pass
                return

    def _fail_live(self, error: BaseException, epoch: int) -> None:
        """Fail every async request: the loop's driver broke."""
        with self._lock:
            outputs, self._outbox = self._outbox, []
            failed = list(self._live)
            self._live.clear()
            gone = set(failed)
            self._admissions = [r for r in self._admissions if r not in gone]
            self._leaves = [r for r in self._leaves if r not in gone]
            for request in failed:
                request.ended = True
            if self._epoch == epoch:
                self._running = False
        self._route(outputs)
        if not isinstance(error, Exception):
            error = RuntimeError("the batch's loop was cancelled")
        for request in failed:
            assert request.output is not None
            request.output.put((error,), gone=True)

    def _route(self, outputs: Outputs) -> None:
        for request, items, gone in outputs:
            assert request.output is not None
            request.output.put(items, gone=gone)
            if gone:
                with self._lock:
                    self._live.discard(request)
