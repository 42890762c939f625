"""The ways to hand work to an MLX thread: ``submit``, ``run``, ``run_sync``,
``iterate`` and ``iterate_sync``, shared by MLXThread and Exclusive.

Caller side: these run on the caller's thread or event loop, never on the
MLX thread (except the inline calls, which run there by design).
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, TypeVar

from ._async_streams import AsyncStreamIterator
from ._jobs import AsyncioCall, Call, FutureCall
from ._keys import sweep_if_cancelled
from ._streams import Stream
from ._sync_streams import SyncStreamIterator
from ._waiters import (
    SyncWaiter,
    async_waiter,
    get_running_loop,
    is_asyncio,
    warn_if_blocking_a_loop,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from concurrent.futures import Future

    from ._worker import Worker

T = TypeVar("T")


class Submitter:
    """The ways to hand work to an MLX thread, shared by :class:`MLXThread`
    (no key) and :class:`Exclusive` (one key). Caller side: any thread."""

    __slots__ = ()
    _key: object  # the exclusive key of the work, or None
    _worker: Worker

    @abstractmethod
    def is_current(self) -> bool:
        """Whether the caller is running on this MLX thread."""

    @abstractmethod
    def _enqueue(self, item: Call[Any] | Stream[Any]) -> None:
        """Queue ``item`` on the thread."""

    @abstractmethod
    def _call_inline(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        """Run ``fn`` now: the caller is on the thread."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` to run on the thread.

        Works from any thread, including the MLXThread itself (the job is
        queued behind the others; waiting for its result there raises
        :class:`MLXThreadDeadlockError` at once, since it could never come).
        ``future.cancel()`` before it starts means it never runs. So
        ``loop.run_in_executor(thread, fn)`` works too.

        Raises:
            MLXThreadBusyError: ``max_pending`` jobs are already queued.
            MLXThreadClosedError: the thread was shut down.
            MLXThreadBrokenError: the thread died.
        """
        key = self._key
        call: FutureCall[T] = FutureCall(fn, args, kwargs, self._worker, key)
        if key is not None:
            call.future.add_done_callback(
                functools.partial(sweep_if_cancelled, self._worker, key)
            )
        self._enqueue(call)
        return call.future

    def run_sync(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the thread and block until it returns.

        Called on the MLXThread itself, it runs inline instead of deadlocking.
        Not cancellable once queued; use :meth:`run` from async code: called
        on a thread that runs an event loop, it warns
        (:class:`BlockingCallWarning`), since it blocks the loop.
        """
        return self._run_blocking(fn, args, kwargs)

    def _run_blocking(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        """:meth:`run_sync`, for it and a decorated function's ``.sync``: one
        frame below both, so a warning points at their caller."""
        if self.is_current():
            return self._call_inline(fn, args, kwargs)
        warn_if_blocking_a_loop("run_sync() or .sync()")
        waiter = SyncWaiter()
        call = Call(fn, args, kwargs, waiter, self._key)
        self._enqueue(call)
        try:
            waiter.wait()
        except BaseException:  # KeyboardInterrupt while waiting
            self._leave(call)
            raise
        return call.result()

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the thread and await its result.

        Works on asyncio and trio; the event loop is never blocked. If the
        caller is cancelled, it is released at once: a job that has not
        started never runs, a running one finishes (it can poll
        :func:`cancel_requested`) and its result is dropped.
        """
        loop = get_running_loop()
        if is_asyncio(loop) and not self.is_current():
            job: AsyncioCall[T] = AsyncioCall(fn, args, kwargs, loop, self._key)  # type: ignore[arg-type]
            self._enqueue(job)
            try:
                return await job.future
            except BaseException:
                self._leave(job)
                raise
        if self.is_current():
            return self.run_sync(fn, *args, **kwargs)
        waiter = async_waiter()
        call = Call(fn, args, kwargs, waiter, self._key)
        self._enqueue(call)
        try:
            await waiter.wait()
        except BaseException:
            self._leave(call)
            raise
        return call.result()

    def iterate(
        self, gen_fn: Callable[..., Iterable[T]], /, *args: Any, **kwargs: Any
    ) -> AsyncStreamIterator[T]:
        """Run the sync generator ``gen_fn(*args, **kwargs)`` on the thread and
        iterate its items asynchronously (asyncio or trio).

        The generator is created and advanced only on the thread, one item per
        turn, so streams interleave item by item with other jobs; at most a
        few items are read ahead, so a slow consumer never holds the thread.
        ``aclose()``, cancelling the consumer or dropping the iterator closes
        the generator on the thread before its next item; use
        ``contextlib.aclosing``.

        Raises:
            MLXThreadBusyError: the queue is full (raised here, at once).
        """
        stream: Stream[T] = Stream(self._worker, gen_fn, args, kwargs, self._key)
        self._enqueue(stream)
        return AsyncStreamIterator(stream)

    def iterate_sync(
        self, gen_fn: Callable[..., Iterable[T]], /, *args: Any, **kwargs: Any
    ) -> SyncStreamIterator[T]:
        """Like :meth:`iterate`, for plain threads: a blocking iterator with
        ``close()``. Must not be consumed on the MLXThread itself."""
        stream: Stream[T] = Stream(self._worker, gen_fn, args, kwargs, self._key)
        self._enqueue(stream)
        return SyncStreamIterator(stream)

    def _leave(self, call: Call[Any]) -> None:
        """The caller gave up waiting: the job must not start."""
        call.cancelled = True
        if call.key is not None:
            self._worker.sweep(call.key)
