"""Work items of the queue: one call of a function, run once on the worker.

A call is made on the caller's thread and run on the MLX thread; what it
needs from the executor there is :class:`JobOwner`, and nothing else.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._exceptions import MLXThreadDeadlockError
from ._mlx import SCALARS, evaluate
from ._waiters import asyncio_inbox

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from ._waiters import Waiter

T = TypeVar("T")

# On a worker thread, ``thread_local.owner`` is its JobOwner (for
# cancel_requested).
thread_local = threading.local()


class Running(Protocol):
    """The job or stream turn running on the worker now."""

    @property
    def fn(self) -> Callable[..., object] | None: ...

    @property
    def cancel_requested(self) -> bool: ...


class JobOwner(Protocol):
    """What a job reads and writes of the executor that runs it.

    Touched on the worker thread only, while the job runs: the worker is the
    only writer of these, so they need no lock.
    """

    eval_results: bool  # evaluate results on the thread
    running: Running | None  # the job running now
    completed_count: int
    failed_count: int
    cancelled_count: int

    def translate(
        self,
        error: BaseException,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> BaseException:
        """The error the caller gets for ``error`` raised by ``fn``."""
        ...

    def is_current(self) -> bool:
        """Whether the caller runs on the executor's thread (any thread)."""
        ...


class Call(Generic[T]):
    """A function call queued on an MLXThread; the worker calls ``run`` once."""

    __slots__ = (
        "args",
        "cancelled",
        "error",
        "fn",
        "key",
        "kwargs",
        "value",
        "waiter",
    )
    counted = True  # counts against max_pending while queued

    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        waiter: Waiter | None,
        key: object = None,
    ) -> None:
        self.fn: Callable[..., T] | None = fn
        self.args = args
        self.kwargs = kwargs
        self.waiter = waiter
        self.key = key  # the exclusive key it holds while it runs, or None
        self.cancelled = False
        self.value: T | None = None
        self.error: BaseException | None = None

    @property
    def cancel_requested(self) -> bool:
        return self.cancelled

    def start(self) -> bool:
        """Whether the job may run (it was not cancelled while queued)."""
        return not self.cancelled

    def run(self, owner: JobOwner) -> None:
        """Run on the worker thread: the hot path, kept flat on purpose."""
        fn = self.fn
        if fn is None or self.cancelled or not self.start():
            owner.cancelled_count += 1
            self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
            self.finish()
            return
        owner.running = self
        try:
            value = fn(*self.args, **self.kwargs)
            if owner.eval_results and not isinstance(value, SCALARS):
                evaluate(value)
        except BaseException as exc:
            self.error = owner.translate(exc, fn, self.args, self.kwargs)
            owner.failed_count += 1
        else:
            self.value = value
            owner.completed_count += 1
        owner.running = None
        # Drop references to arguments now: they may hold large arrays.
        self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        self.finish()

    def abandon(self, error: BaseException) -> None:
        """End the job without running it (the thread shut down or broke)."""
        self.fn = None
        self.error = error
        self.finish()

    def finish(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            waiter.wake()

    def result(self) -> T:
        error = self.error
        if error is not None:
            self.error = None  # break the frame <-> exception reference cycle
            try:
                raise error
            finally:
                del error
        return self.value  # type: ignore[return-value]


class JobFuture(Future[T]):
    """The future of a job: waiting for it on the job's own MLX thread,
    where it can never finish, raises at once instead of hanging."""

    def __init__(self, owner: JobOwner) -> None:
        super().__init__()
        self._owner = owner

    def result(self, timeout: float | None = None) -> T:
        self._refuse_a_wait_for_itself(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._refuse_a_wait_for_itself(timeout)
        return super().exception(timeout)

    def _refuse_a_wait_for_itself(self, timeout: float | None) -> None:
        if timeout != 0 and not self.done() and self._owner.is_current():
            raise MLXThreadDeadlockError(
                "A job on the MLX thread waited for the future of another job"
                " of that thread, which can only run after it: call the"
                " function directly, or with run_sync (it runs inline there),"
                " or wait for the future off the MLX thread."
            )


class FutureCall(Call[T]):
    """A call whose outcome is a ``concurrent.futures.Future`` (``submit``)."""

    __slots__ = ("future",)

    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        owner: JobOwner,
        key: object = None,
    ) -> None:
        super().__init__(fn, args, kwargs, None, key)
        self.future: Future[T] = JobFuture(owner)

    @property
    def cancel_requested(self) -> bool:
        return self.cancelled or self.future.cancelled()

    def start(self) -> bool:
        return not self.cancelled and self.future.set_running_or_notify_cancel()

    def abandon(self, error: BaseException) -> None:
        self.fn = None
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)

    def cancel_queued(self) -> None:
        """Cancel the future (``shutdown(cancel_futures=True)``)."""
        self.fn = None
        self.future.cancel()

    def finish(self) -> None:
        future = self.future
        if not future.running():  # cancelled before it started
            return
        if self.error is not None:
            future.set_exception(self.error)
            self.error = None
        else:
            future.set_result(self.value)  # type: ignore[arg-type]


class AsyncioCall(Call[T]):
    """A call awaited by an asyncio task: its own waiter, woken in batches."""

    __slots__ = ("future", "inbox")

    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        key: object = None,
    ) -> None:
        # Flat on purpose: this runs once per awaited call.
        self.fn: Callable[..., T] | None = fn
        self.args = args
        self.kwargs = kwargs
        self.waiter = None
        self.key = key
        self.cancelled = False
        self.value: T | None = None
        self.error: BaseException | None = None
        self.inbox = asyncio_inbox(loop)
        self.future: asyncio.Future[T] = loop.create_future()

    def finish(self) -> None:  # on the worker
        self.inbox.post(self)

    def deliver(self) -> None:  # on the loop's thread
        future = self.future
        if not future.done():
            if self.error is not None:
                future.set_exception(self.error)
                self.error = None
            else:
                future.set_result(self.value)  # type: ignore[arg-type]
