"""How a finished job wakes whoever waits for it, without ever blocking.

The worker thread only calls ``wake()``: for an event loop that appends to the
loop's inbox and, if the loop has not been woken yet, schedules one drain with
a thread-safe call. A burst of completions therefore costs the loop one
wake-up, not one per job. Waiters whose loop has closed, or whose task was
cancelled meanwhile, are dropped quietly.
"""

from __future__ import annotations

import abc
import asyncio
import threading
import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import sniffio

from ._exceptions import BlockingCallWarning

if TYPE_CHECKING:
    from collections.abc import Callable


class Waiter(Protocol):
    """Something a caller waits on and the worker thread wakes, once."""

    def wake(self) -> None: ...


class Deliverable(Protocol):
    """A completion that an event loop's inbox hands over on the loop's thread."""

    def deliver(self) -> None: ...


class _Inbox:
    """Completions bound for one event loop, delivered in batches."""

    __slots__ = ("_call_soon", "_items", "_scheduled")

    def __init__(self, call_soon: Callable[[Callable[[], object]], object]) -> None:
        self._call_soon = call_soon
        self._items: deque[Deliverable] = deque()
        self._scheduled = False

    def post(self, waiter: Deliverable) -> None:
        # Append before reading the flag: a drain clears the flag before it
        # pops, so either it sees this item or we schedule another drain.
        self._items.append(waiter)
        if not self._scheduled:
            self._scheduled = True
            try:
                self._call_soon(self._drain)
            except RuntimeError:  # the loop is closed (or trio's run finished)
                self._items.clear()

    def _drain(self) -> None:
        self._scheduled = False
        items = self._items
        while items:
            items.popleft().deliver()


class LoopWaiter(abc.ABC):
    __slots__ = ("_inbox",)

    def __init__(self, inbox: _Inbox) -> None:
        self._inbox = inbox

    def wake(self) -> None:
        self._inbox.post(self)

    @abc.abstractmethod
    def deliver(self) -> None:
        """Hand the completion over; called on the loop's own thread."""


_asyncio_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = (
    weakref.WeakKeyDictionary()
)
_inbox_lock = threading.Lock()
# The loop asked for last and its inbox: the common case, one loop per process.
_last: tuple[object, Any] = (None, None)
_ASYNCIO = (None, "asyncio")
get_running_loop = asyncio._get_running_loop  # None outside a loop; no raise


def asyncio_inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    """The inbox of ``loop`` (called on the loop's own thread)."""
    last = _last  # one tuple read: safe against other threads replacing it
    if last[0] is loop:
        inbox: _Inbox = last[1]
        return inbox
    return _new_asyncio_inbox(loop)


def _new_asyncio_inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    global _last
    with _inbox_lock:
        found = _asyncio_inboxes.get(loop)
        if found is None:
            # A weak reference, so the inbox does not keep its loop alive.
            loop_ref = weakref.ref(loop)

            def call_soon(callback: Callable[[], object]) -> None:
                live = loop_ref()
                if live is None:
                    raise RuntimeError("event loop is gone")
                live.call_soon_threadsafe(callback)

            found = _asyncio_inboxes[loop] = _Inbox(call_soon)
        _last = (loop, found)
    return found


def is_asyncio(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether the caller is an asyncio task (fast path; trio otherwise)."""
    # anyio sets the variable to "asyncio"; trio-in-asyncio modes set "trio".
    return loop is not None and sniffio.current_async_library_cvar.get() in _ASYNCIO


class AsyncioWaiter(LoopWaiter):
    """Wakes an asyncio task through its loop's inbox."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(asyncio_inbox(loop))
        self._future: asyncio.Future[None] = loop.create_future()

    def deliver(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        await self._future


class TrioWaiter(LoopWaiter):
    """Wakes a trio task through its run's token."""

    __slots__ = ("_task",)

    def __init__(self) -> None:
        import trio

        super().__init__(_trio_inbox())
        self._task: Any = trio.lowlevel.current_task()

    def deliver(self) -> None:
        import trio

        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        import trio

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None  # a late wake-up must not reschedule this task
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


_trio_inbox_var: Any = None


def _trio_inbox() -> _Inbox:
    global _trio_inbox_var
    import trio

    if _trio_inbox_var is None:
        _trio_inbox_var = trio.lowlevel.RunVar("mlx_pinned_inbox")
    inbox: _Inbox | None = _trio_inbox_var.get(None)
    if inbox is None:
        inbox = _Inbox(trio.lowlevel.current_trio_token().run_sync_soon)
        _trio_inbox_var.set(inbox)
    return inbox


def loop_here() -> str | None:
    """The event loop that runs on the calling thread ("asyncio", "trio"),
    or None. Cheap: one call and one thread-local read."""
    if get_running_loop() is not None:
        return "asyncio"
    name: str | None = sniffio.thread_local.name  # set by trio while it runs
    return name


def warn_if_blocking_a_loop(what: str) -> None:
    """Warn that ``what`` blocks the event loop running here, if one is.

    Called two frames below the user's call: the warning points at it.
    """
    loop = loop_here()
    if loop is not None:
        warnings.warn(
            f"{what} on a thread that runs the {loop} event loop blocks the"
            " whole loop until the MLX thread answers: await the call instead"
            " (await thread.run(...), await the decorated function, or"
            " async for over thread.iterate(...)).",
            BlockingCallWarning,
            stacklevel=4,
        )


def async_waiter() -> AsyncioWaiter | TrioWaiter:
    """A waiter for the calling task, on asyncio or trio."""
    if is_asyncio(get_running_loop()):
        return AsyncioWaiter()
    library = sniffio.current_async_library()
    if library == "trio":
        return TrioWaiter()
    raise RuntimeError(f"mlx-pinned supports asyncio and trio, not {library}")


class SyncWaiter:
    """Blocks a plain thread until woken."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def wake(self) -> None:
        self._lock.release()

    def wait(self) -> None:
        self._lock.acquire()
