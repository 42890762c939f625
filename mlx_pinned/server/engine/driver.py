"""The engine's event-loop side (asyncio or trio; no MLX here): the
:class:`Driver` task that follows a loop's ``MLXThread.iterate`` stream,
and each request's :class:`RowOutput`, read through its :class:`RowStream`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import anyio
import sniffio

from ..events import Event, EventStream, FinalEvent, GenerationParams, PromptProgress
from .answers import Item, Outputs, Request

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread
    from mlx_pinned.types import AsyncStreamIterator, Checkpoint

    from .loop import BatchLoop

__all__ = [
    "READ_AHEAD",
    "Driver",
    "Loop",
    "LoopDriver",
    "RowOutput",
    "RowStream",
    "spawn",
]


logger = logging.getLogger("mlx_pinned.server")

# Turns the loop may run ahead of its driver: a busy event loop never holds
# the batch up, and a driver that went away stops it soon.
READ_AHEAD = 64

_tasks: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references

Out = TypeVar("Out")  # a turn's outputs
Out_co = TypeVar("Out_co", covariant=True)


def spawn(fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Run ``fn(*args)`` as a task of the running event loop that outlives its
    caller (a driver serves every request, not the one that started it)."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn, *args)
        return
    task = asyncio.get_running_loop().create_task(fn(*args))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


# As many events as there are: what a flowing or whole reader takes.
_ALL = 1 << 30


class RowOutput:
    """One request's items on their way from the driver to its reader.
    Event loop only. The reader wakes when as many items as it asked for
    are in, or the answer ended; its prompt's progress is kept apart (the
    latest), and wakes who waits for it."""

    def __init__(self) -> None:
        self._items: deque[Event | BaseException] = deque()
        self._ended = False
        self._want = 1
        self._ready: anyio.Event | None = None
        self._gone: anyio.Event | None = None
        self._moved: anyio.Event | None = None  # set by any item
        self.gone = False  # the loop holds no row of it
        self.progress: PromptProgress | None = None

    def put(self, items: tuple[Item, ...], *, gone: bool) -> None:
        moved = self._moved
        if moved is not None and (items or gone):
            self._moved = None
            moved.set()
        if len(items) == 1 and isinstance(items[0], PromptProgress):
            self.progress = items[0]  # the loop hands each out alone
            items = ()
        self._items.extend(cast("tuple[Event | BaseException, ...]", items))
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

    async def accepted(self) -> PromptProgress | None:
        """The first progress, once the loop took the request; None if an
        event or the end came first (a refusal: the events raise it)."""
        while self.progress is None and not (self._items or self._ended):
            self._moved = moved = anyio.Event()
            await moved.wait()
        return self.progress

    async def prefill(self) -> AsyncGenerator[PromptProgress, None]:
        """Each new progress, until the first event (or the end) is in."""
        seen: PromptProgress | None = None
        while True:
            if self.progress is not seen:
                seen = self.progress
                assert seen is not None
                yield seen
            if self._items or self._ended:
                return
            if self.progress is seen:
                self._moved = moved = anyio.Event()
                await moved.wait()

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
        if not self.gone:
            self._gone = gone = anyio.Event()
            await gone.wait()


class RowStream:
    """What a request's :class:`~..events.EventStream` reads; closing it (or
    cancelling its reader, or dropping it) takes the row out at the loop's
    next turn. Event loop only."""

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
        """The events in tuples of up to ``n``, one wake-up per tuple; None: every
        event in one tuple, once the answer ended."""
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
        """The events as they come, at most one wake-up each ``interval`` seconds
        (but the first: an answer's first token goes out at once)."""
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

    async def accepted(self) -> PromptProgress | None:
        """As :meth:`RowOutput.accepted`; cancelled, it takes the row out."""
        try:
            return await self._output.accepted()
        except BaseException:
            self._loop.close(self._request)
            raise

    async def prefill(self) -> AsyncGenerator[PromptProgress, None]:
        """As :meth:`RowOutput.prefill`; cancelled, it takes the row out."""
        try:
            async for progress in self._output.prefill():
                yield progress
        except GeneratorExit:  # its reader stopped early: no cancellation
            raise
        except BaseException:
            self._loop.close(self._request)
            raise

    async def aclose(self) -> None:
        """Take the row out, and wait until the loop did."""
        self._finalizer.detach()
        if self._loop.close(self._request):
            await self._output.wait_gone()


class Loop(Protocol[Out_co]):
    """A loop of turns on the MLX thread, as its driver sees it."""

    def run(self) -> Generator[tuple[Out_co, bool] | Checkpoint, None, None]: ...

    def waiting(self) -> bool:
        """Any thread."""
        ...


L = TypeVar("L", bound=Loop[Any])  # the loop a driver follows


class Driver(ABC, Generic[L, Out]):
    """The event-loop side of a loop on the MLX thread: it starts the loop's
    stream when a request comes and none runs, and its task routes each
    item's outputs (:meth:`_route`) until the loop ends, starting it again
    while commands came meanwhile. Event loop only."""

    def __init__(self, loop: L, thread: MLXThread) -> None:
        self.loop = loop
        self.thread = thread
        self.running = False  # a driver task follows the loop's stream

    def start(self) -> None:
        """Start the loop and its driver task, unless they run.

        Raises:
            MLXThreadClosedError: The thread is closed.
            MLXThreadBusyError: The thread's queue is full.
        """
        if not self.running:
            spawn(self._drive, self._start())

    @abstractmethod
    def _route(self, outputs: Out) -> None:
        """Hand one turn's outputs to their requests."""

    @abstractmethod
    def _fail(self, error: Exception) -> None:
        """The loop's stream broke: fail every request still live."""

    def _start(self) -> AsyncStreamIterator[tuple[Out, bool]]:
        # The loop's checkpoints are no items: the stream carries outputs.
        items = cast(
            "AsyncStreamIterator[tuple[Out, bool]]", self.thread.iterate(self.loop.run)
        )
        items.read_ahead(READ_AHEAD)
        self.running = True
        return items

    async def _drive(self, items: AsyncStreamIterator[tuple[Out, bool]]) -> None:
        """Route the loop's outputs until it ends, starting it again while commands
        came meanwhile; if it breaks, fail every request."""
        try:
            while True:
                last: Out | None = None
                async with items:
                    async for outputs, ended in items:
                        if ended:
                            last = outputs
                        else:
                            self._route(outputs)
                if last is not None:
                    self._route(last)
                # No await from here to the end: a submission sees the flag.
                if not self.loop.waiting():
                    self.running = False
                    return
                items = self._start()
        except BaseException as exc:
            self.running = False
            if not isinstance(exc, Exception):
                self._fail(RuntimeError("the loop was cancelled"))
                raise  # the event loop is going away
            self._fail(exc)
            logger.debug("a loop stopped", exc_info=True)


class LoopDriver(Driver["BatchLoop", Outputs]):
    """The event-loop side of a model's :class:`~.loop.BatchLoop`. Event loop
    only, but :meth:`close` (any thread)."""

    def __init__(self, loop: BatchLoop, thread: MLXThread) -> None:
        super().__init__(loop, thread)
        self._live: set[Request] = set()  # submitted, not yet gone

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> EventStream:
        """Submit a generation; its events. Starts the loop when it is not running.

        Raises:
            MLXThreadClosedError: The thread is closed.
            MLXThreadBusyError: The thread's queue is full.
        """
        request = Request(params, images, RowOutput())
        self.loop.submit(request)
        try:
            self.start()
        except BaseException:
            request.ended = True  # the loop skips its admission
            raise
        self._live.add(request)
        return EventStream(RowStream(self, request))

    def close(self, request: Request) -> bool:
        """Take ``request``'s row out at the loop's next turn; any thread. Whether
        the loop holds it still (its output then says when it left)."""
        if request.ended:
            return False
        self.loop.leave(request)
        return True

    def whole(self, request: Request) -> None:
        """The loop hands ``request``'s events out in one output, when it ended."""
        self.loop.whole(request)

    def _route(self, outputs: Outputs) -> None:
        for request, items, gone in outputs:
            assert request.output is not None
            request.output.put(items, gone=gone)
            if gone:
                self._live.discard(request)

    def _fail(self, error: Exception) -> None:
        failed, self._live = self._live, set()
        for request in failed:
            request.ended = True
            assert request.output is not None
            request.output.put((error,), gone=True)
