"""MLXThread: an executor that owns one OS thread and that thread's MLX stream."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any, TypeVar

from . import _jobs
from ._exceptions import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
)
from ._jobs import AsyncioCall, Call, FutureCall, Running
from ._mlx import ThreadStream, affinity_error, evaluate, is_stream_error, job_name
from ._streams import AsyncStreamIterator, Stream, SyncStreamIterator
from ._waiters import SyncWaiter, async_waiter, get_running_loop, is_asyncio

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import TracebackType

T = TypeVar("T")

_STOP = object()
_NEW, _RUNNING, _CLOSED = "new", "running", "closed"


@dataclass(frozen=True)
class MLXThreadStatistics:
    """A snapshot of an :class:`MLXThread`'s queue and counters.

    Attributes:
        pending: jobs and streams queued and not started (what ``max_pending``
            bounds); the running job is not counted.
        running: name of the job running now, or ``None``.
        completed: jobs and streams that ended with a result.
        failed: jobs and streams that ended with an exception.
        cancelled: jobs and streams that never started or were closed early.
        busy_time: seconds the thread spent running jobs.
        open_streams: streams whose generator exists on the thread.
        max_pending: the queue bound, ``None`` for unbounded.
        waiting_for_key: ``(key, count)`` for each exclusive key that keyed
            jobs and streams are waiting for (another holder of the key is
            open); they are counted in ``pending`` too.
    """

    pending: int
    running: str | None
    completed: int
    failed: int
    cancelled: int
    busy_time: float
    open_streams: int
    max_pending: int | None
    waiting_for_key: tuple[tuple[object, int], ...] = field(default=())


class _Worker:
    """What an MLXThread shares with its jobs and streams: its queue, lock,
    state and counters. Implements :class:`JobOwner` and :class:`StreamOwner`.

    Under ``lock``, from any thread: ``state``, ``dead``, ``submitted_count``,
    ``discarded_count`` and puts that must not race the worker's end. On the
    worker thread only (no lock): ``running``, ``open_streams``, the
    started, completed, failed and cancelled counts and the busy clock.
    Read without the lock from any thread: the rest, and the counts for
    ``statistics()``.
    """

    __slots__ = (
        "broken",
        "broken_why",
        "busy_since",
        "busy_time",
        "cancel_running",
        "cancelled_count",
        "completed_count",
        "dead",
        "discarded_count",
        "eval_results",
        "failed_count",
        "holders",
        "ident",
        "lock",
        "name",
        "open_streams",
        "queue",
        "ready",
        "running",
        "started_count",
        "state",
        "submitted_count",
        "waiting",
    )

    def __init__(self, name: str, eval_results: bool) -> None:
        self.name = name
        self.eval_results = eval_results
        # Reentrant: a stream iterator collected while the worker holds the
        # lock (garbage collection can run anywhere) queues its close turn.
        self.lock = threading.RLock()
        self.queue: SimpleQueue[Any] = SimpleQueue()
        self.state = _NEW
        self.ident: int | None = None
        self.dead = False  # the worker has drained its queue for the last time
        self.broken: BaseException | None = None
        self.broken_why: str | None = None  # how it broke, when it did
        self.cancel_running = False  # shutdown(cancel_futures=True) was called
        self.submitted_count = 0  # counted items queued
        self.started_count = 0  # counted items the worker took
        self.discarded_count = 0  # counted items removed without a turn
        self.completed_count = self.failed_count = self.cancelled_count = 0
        self.busy_time = 0.0  # seconds in finished busy periods
        self.busy_since: float | None = None  # start of the current one
        self.running: Running | None = None
        self.open_streams: set[Stream[Any]] = set()
        # Exclusive keys, on the worker thread only: the job or stream that
        # holds each key, the work waiting for it (FIFO), and the work handed
        # a key that was let go, which runs before the next queued item.
        self.holders: dict[object, Running] = {}
        self.waiting: dict[object, deque[Any]] = {}
        self.ready: deque[Any] = deque()

    @property
    def closed(self) -> bool:
        return self.state is _CLOSED or self.broken is not None

    def pending(self) -> int:
        """Counted items queued and not taken by the worker."""
        return self.submitted_count - self.started_count - self.discarded_count

    def is_current(self) -> bool:
        return threading.get_ident() == self.ident

    def requeue(self, stream: Stream[Any]) -> None:
        with self.lock:
            if not self.dead:
                self.queue.put(stream)
                return
        stream.abandon(self.closed_error())

    def sweep(self, key: object) -> None:
        with self.lock:
            if not self.dead:
                self.queue.put(_Sweep(key))

    # -- exclusive keys: worker thread only ----------------------------------

    def admit(self, item: Any) -> bool:
        """Whether keyed ``item`` may take its turn now; if another holder of
        its key is open, it waits for the key instead."""
        key = item.key
        holder = self.holders.get(key)
        if holder is None:
            if item.fn is not None:
                self.holders[key] = item
            return True
        # Its own later turn, or one that ends without running.
        if holder is item or item.fn is None or item.cancel_requested:
            return True
        waiting = self.waiting.get(key)
        if waiting is None:
            waiting = self.waiting[key] = deque()
        waiting.append(item)
        return False

    def let_go(self, item: Any) -> None:
        """``item`` has ended: hand its key to the first live waiter, which
        takes its turn next."""
        key = item.key
        if self.holders.get(key) is not item:
            return
        # Shut down: what waits for a key never starts; the end takes it.
        waiting = None if self.state is _CLOSED else self.waiting.get(key)
        while waiting:
            successor = waiting.popleft()
            if successor.fn is not None:
                self.holders[key] = successor
                self.ready.append(successor)
                break
        else:
            del self.holders[key]
        if waiting is not None and not waiting:
            del self.waiting[key]

    def end_waiters_that_left(self, key: object) -> None:
        """End the work waiting for ``key`` whose caller left (cancelled, or
        its stream closed) now, instead of once the key is free."""
        waiting = self.waiting.get(key)
        if not waiting:
            return
        left = [item for item in waiting if item.fn is None or item.cancel_requested]
        if not left:
            return
        staying = deque(item for item in waiting if item not in left)
        if staying:
            self.waiting[key] = staying
        else:
            del self.waiting[key]
        for item in left:
            if item.fn is None:
                continue
            if item.counted:
                self.started_count += 1
            item.run(self)  # it sees it was cancelled or closed, and ends

    def take_waiting(self) -> list[Any]:
        """Remove and return all work waiting for a key (at the end)."""
        items = [item for item in self.ready if item.fn is not None]
        for waiting in self.waiting.values():
            items.extend(item for item in waiting if item.fn is not None)
        self.ready.clear()
        self.waiting.clear()
        self.holders.clear()
        return items

    def check_inline(self, key: object) -> None:
        """Refuse an inline call with ``key`` while another holder of it is
        open: it could neither run now nor wait (the worker is busy here)."""
        holder = self.holders.get(key)
        if holder is not None and holder is not self.running:
            raise MLXThreadDeadlockError(
                f"MLX thread {self.name!r} cannot run this call inline: its"
                f" exclusive key {_user_key(key)!r} is held by another open job"
                " or stream, and waiting for it here would wait forever; queue"
                " it with submit() and do not wait for it on the thread."
            )

    def closed_error(self) -> MLXThreadClosedError | MLXThreadBrokenError:
        if self.broken is not None:
            error = MLXThreadBrokenError(
                self.broken_why
                or f"MLX thread {self.name!r} is broken ({self.broken!r}):"
                " create a new MLXThread."
            )
            error.__cause__ = self.broken
            return error
        return MLXThreadClosedError(
            f"MLX thread {self.name!r} was shut down: create a new MLXThread."
        )

    def translate(
        self,
        error: BaseException,
        fn: Callable[..., object] | str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> BaseException:
        if isinstance(error, StopIteration):
            # A StopIteration set on an asyncio future hangs its awaiter.
            new: BaseException = RuntimeError(
                f"job {_job_name(fn)!r} raised StopIteration"
            )
        elif is_stream_error(error):
            new = affinity_error(error, fn, args, kwargs, self.name)
        else:
            return error
        new.__cause__ = error
        new.__traceback__ = error.__traceback__
        return new


class _Submitter:
    """The ways to hand work to an MLX thread, shared by :class:`MLXThread`
    (no key) and :class:`Exclusive` (one key). Caller side: any thread."""

    __slots__ = ()
    _key: object  # the exclusive key of the work, or None
    _worker: _Worker

    def is_current(self) -> bool:
        """Whether the caller is running on this MLX thread."""
        raise NotImplementedError

    def _enqueue(self, item: Call[Any] | Stream[Any]) -> None:
        raise NotImplementedError

    def _call_inline(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        raise NotImplementedError

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
                functools.partial(_sweep_if_cancelled, self._worker, key)
            )
        self._enqueue(call)
        return call.future

    def run_sync(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the thread and block until it returns.

        Called on the MLXThread itself, it runs inline instead of deadlocking.
        Not cancellable once queued; use :meth:`run` from async code.
        """
        if self.is_current():
            return self._call_inline(fn, args, kwargs)
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


class Exclusive(_Submitter):
    """Work on one MLXThread that never overlaps other work with the same key.

    Returned by :meth:`MLXThread.exclusive`; it has the thread's ``submit``,
    ``run``, ``run_sync``, ``iterate`` and ``iterate_sync``, with the same
    signatures, and runs on the same thread. On that thread, work that
    shares a key never overlaps: a job holds its key while it runs, a stream
    from its first turn until its generator ends or is closed. Keyed work
    whose key is held waits, first in first out per key, while work with no
    key or another key still runs between the holder's items. A call from a
    job that holds the key, on the thread itself, runs inline.

    Waiting work counts against ``max_pending`` and is listed in
    ``statistics().waiting_for_key``. Cancelled while waiting, it never
    starts and its caller is released at once; still waiting when the
    thread stops, it ends with :class:`MLXThreadClosedError` (a future from
    ``submit`` is cancelled under ``shutdown(cancel_futures=True)``).

    Attributes:
        key: the key, as given.
        thread: the MLXThread the work runs on.
    """

    __slots__ = ("_key", "_worker", "thread")

    def __init__(self, thread: MLXThread, key: object) -> None:
        self.thread = thread
        self._worker = thread._worker
        # Compared by equality when hashable (a name), else by identity (an
        # nn.Module is a dict, so it is unhashable).
        self._key = key if _hashable(key) else _Identity(key)

    @property
    def key(self) -> object:
        return _user_key(self._key)

    def __repr__(self) -> str:
        return f"<Exclusive {self.key!r} on {self.thread!r}>"

    def is_current(self) -> bool:
        return threading.get_ident() == self._worker.ident

    def _enqueue(self, item: Call[Any] | Stream[Any]) -> None:
        self.thread._enqueue(item)

    def _call_inline(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        self._worker.check_inline(self._key)
        return self.thread._call_inline(fn, args, kwargs)


class _Identity:
    """An unhashable key, compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


def _hashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _user_key(key: object) -> object:
    return key.value if isinstance(key, _Identity) else key


class _Sweep:
    """A queue item: end the work waiting for ``swept`` whose caller left."""

    __slots__ = ("swept",)
    counted = False  # never refused, never counted as pending
    key = None  # holds no key itself
    fn = None

    def __init__(self, swept: object) -> None:
        self.swept = swept

    def run(self, worker: _Worker) -> None:
        worker.end_waiters_that_left(self.swept)

    def abandon(self, error: BaseException) -> None:
        """Nothing waits on a sweep."""


def _sweep_if_cancelled(worker: _Worker, key: object, future: Future[Any]) -> None:
    if future.cancelled():
        worker.sweep(key)


class MLXThread(_Submitter, Executor):
    """An executor that runs every job on one dedicated thread with its own stream.

    MLX streams are thread-local, so a model must be loaded, run and evaluated
    on one thread. Every job submitted here runs on that thread, in order; its
    result is evaluated there (``eval_results``) so no lazy array escapes.

    The thread starts on first use (or ``start()``) and stops with
    ``shutdown()``/``aclose()``, a ``with`` block, or at interpreter exit.

    Args:
        name: the thread's name.
        device: the MLX device of the thread's stream; the default device if
            ``None``.
        max_pending: the most jobs that may wait in the queue; past it,
            submitting raises :class:`MLXThreadBusyError`. ``None``: unbounded.
        initializer: called on the thread after its stream is set up and
            before any job (load a model here). If it raises, the thread is
            broken.
        finalizer: called on the thread after the last job, before the
            thread's streams are cleared.
        eval_results: evaluate results and stream items on the thread.
    """

    _key = None  # work given to the thread itself holds no exclusive key

    def __init__(
        self,
        *,
        name: str = "mlx-pinned",
        device: Any = None,
        max_pending: int | None = 1024,
        initializer: Callable[[], object] | None = None,
        finalizer: Callable[[], object] | None = None,
        eval_results: bool = True,
    ) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be 1 or more, or None: {max_pending}")
        self.name = name
        self.device = device
        self.max_pending = max_pending
        self._initializer = initializer
        self._finalizer = finalizer
        self._worker = _Worker(name, eval_results)
        self._thread: threading.Thread | None = None
        self._mlx_stream: ThreadStream | None = None
        _all_threads.add(self)

    def __repr__(self) -> str:
        return f"<MLXThread {self.name!r} {self._worker.state}>"

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the thread if it is not running yet; safe to call again.

        Raises:
            MLXThreadClosedError: it was shut down.
        """
        worker = self._worker
        with worker.lock:
            if worker.state is _RUNNING:
                return
            if worker.state is _CLOSED:
                raise worker.closed_error()
            try:
                _register_exit_hook()
            except RuntimeError:  # the interpreter is already shutting down
                worker.state = _CLOSED
                raise MLXThreadClosedError(
                    f"MLX thread {self.name!r} cannot start: the interpreter is"
                    " shutting down."
                ) from None
            thread = threading.Thread(target=self._work, name=self.name)
            thread.start()
            self._thread, worker.ident, worker.state = thread, thread.ident, _RUNNING

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting jobs and stop the thread once the queue is done.

        Queued jobs still run unless ``cancel_futures``, which cancels them
        (awaiting callers get :class:`MLXThreadClosedError`) and makes
        :func:`cancel_requested` true for the running job. Open streams are
        closed on the thread; their consumers get :class:`MLXThreadClosedError`.

        Args:
            wait: block until the thread has exited (ignored on the thread itself).
            cancel_futures: cancel the jobs still queued.
        """
        worker = self._worker
        discarded: list[Call[Any] | Stream[Any]] = []
        with worker.lock:
            if worker.state is _NEW:
                worker.state = _CLOSED
                return
            if worker.state is _RUNNING:
                worker.state = _CLOSED
                if cancel_futures:
                    worker.cancel_running = True
                    discarded = self._take_queued()
                worker.queue.put(_STOP)
        # Ended outside the lock: ending a stream takes its own lock, which a
        # thread holding it may hold while it queues a turn (under _lock).
        for item in discarded:
            if isinstance(item, FutureCall):
                item.cancel_queued()
            else:
                item.abandon(
                    MLXThreadClosedError(
                        f"MLX thread {self.name!r} was shut down with"
                        " cancel_futures=True before this job started."
                    )
                )
        thread = self._thread
        if wait and thread is not None and not self.is_current():
            thread.join()

    async def aclose(self, *, cancel_futures: bool = False) -> None:
        """Shut down without blocking the event loop; see :meth:`shutdown`.

        Cancelling the caller stops the wait, not the shutdown.
        """
        import anyio

        self.shutdown(wait=False, cancel_futures=cancel_futures)
        thread = self._thread
        if thread is not None and not self.is_current() and thread.is_alive():
            await anyio.to_thread.run_sync(thread.join, abandon_on_cancel=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.shutdown(wait=True)

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- introspection -------------------------------------------------------

    @property
    def ident(self) -> int | None:
        """The worker thread's ``threading.get_ident()``, ``None`` before start."""
        return self._worker.ident

    def is_current(self) -> bool:
        """Whether the caller is running on this MLXThread."""
        return threading.get_ident() == self._worker.ident

    @property
    def closed(self) -> bool:
        """Whether ``shutdown()`` was called or the thread broke."""
        return self._worker.closed

    def statistics(self) -> MLXThreadStatistics:
        """Counters and queue depth, read without stopping the thread."""
        worker = self._worker
        job, since = worker.running, worker.busy_since
        fn = None if job is None else job.fn
        busy = worker.busy_time + (
            0.0 if since is None else time.perf_counter() - since
        )
        return MLXThreadStatistics(
            pending=max(0, worker.pending()),
            running=None if fn is None else _job_name(fn),
            completed=worker.completed_count,
            failed=worker.failed_count,
            cancelled=worker.cancelled_count + worker.discarded_count,
            busy_time=busy,
            open_streams=len(worker.open_streams),
            max_pending=self.max_pending,
            # list(): one step that another thread cannot interleave with.
            waiting_for_key=tuple(
                (_user_key(key), len(waiting))
                for key, waiting in list(worker.waiting.items())
                if waiting
            ),
        )

    def exclusive(self, key: object) -> Exclusive:
        """A handle whose work never overlaps other work with the same key.

        For models that keep request state on themselves (mlx-vlm's Qwen-VL
        family keeps rope state on the model): two generations interleaved
        item by item on this thread would read each other's state. See
        :class:`Exclusive` for the exact rules.

        Args:
            key: any object other than ``None``: a name, or the model itself.
                Hashable keys are compared by equality, others by identity.

        Raises:
            ValueError: ``key`` is ``None``.
        """
        if key is None:
            raise ValueError("an exclusive key cannot be None")
        return Exclusive(self, key)

    # -- internals -------------------------------------------------------

    def _enqueue(self, item: Call[Any] | Stream[Any]) -> None:
        worker = self._worker
        if worker.state is _NEW:
            self.start()
        with worker.lock:
            if worker.state is not _RUNNING or worker.dead:
                raise worker.closed_error()
            if self.max_pending is not None and worker.pending() >= self.max_pending:
                raise MLXThreadBusyError(
                    f"MLX thread {self.name!r} already has {self.max_pending} jobs"
                    " queued: retry later, or raise max_pending."
                )
            worker.submitted_count += 1
            worker.queue.put(item)

    def _take_queued(self) -> list[Call[Any] | Stream[Any]]:
        """Remove the queued items, counted as discarded (under the lock);
        the caller ends them once the lock is released."""
        worker = self._worker
        taken = []
        for item in _drain(worker.queue):
            if item is _STOP:
                worker.queue.put(item)
                continue
            if item.counted:
                worker.discarded_count += 1
            taken.append(item)
        return taken

    def _call_inline(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        """Run ``fn`` now, on this very thread (a job calling its own thread)."""
        try:
            value = fn(*args, **kwargs)
            if self._worker.eval_results:
                evaluate(value)
        except BaseException as exc:
            error = self._worker.translate(exc, fn, args, kwargs)
            if error is exc:
                raise
            raise error from exc
        return value

    def _work(self) -> None:
        """The worker thread's main loop."""
        worker = self._worker
        # First: start() sets it only after this thread runs, and the
        # initializer may call run_sync, which must run inline here.
        worker.ident = threading.get_ident()
        step = "creating its MLX stream"
        # Seen on the CUDA backend in a forked child: "cudaSetDevice failed:
        # initialization error" (CUDA does not survive fork).
        hint = (
            "is the device usable in this process? A GPU backend cannot be "
            "used in a child made with os.fork() after the parent used it: "
            "start worker processes with 'spawn'."
        )
        try:
            self._mlx_stream = ThreadStream(self.device, self.name)
            step = "its initializer"
            hint = "fix its initializer and create a new MLXThread."
            if self._initializer is not None:
                self._initializer()
        except BaseException as exc:
            # Set before broken: whoever sees it broken reads why (a call
            # racing the failure is refused with this, not a vaguer word).
            worker.broken_why = (
                f"MLX thread {self.name!r} failed to start: {step} raised"
                f" {exc!r}; {hint}"
            )
            worker.broken = exc
            self._finish(MLXThreadBrokenError(worker.broken_why), exc)
            return
        _jobs.thread_local.owner = worker
        queue = worker.queue
        get_nowait, adopt = queue.get_nowait, self._mlx_stream.adopt_module_streams
        ready, admit, let_go = worker.ready, worker.admit, worker.let_go
        clock = time.perf_counter
        worker.busy_since = clock()
        try:
            while True:
                if ready:
                    item = ready.popleft()
                else:
                    try:
                        item = get_nowait()
                    except Empty:
                        # Busy time is counted per busy period, not per job:
                        # two clock reads per wake-up instead of two per job.
                        worker.busy_time += clock() - worker.busy_since
                        worker.busy_since = None
                        item = queue.get()
                        worker.busy_since = clock()
                if item is _STOP:
                    break
                key = item.key
                if key is not None and not admit(item):
                    continue  # it waits for its key
                if item.counted:
                    worker.started_count += 1
                adopt()
                item.run(worker)
                if key is not None and item.fn is None:  # it ended
                    let_go(item)
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            worker.broken = exc
            raise
        finally:
            if worker.busy_since is not None:
                worker.busy_time += clock() - worker.busy_since
                worker.busy_since = None
            self._finish(
                MLXThreadClosedError(f"MLX thread {self.name!r} was shut down."), None
            )

    def _finish(self, error: BaseException, cause: BaseException | None) -> None:
        """End every job still queued, close open streams, then clean up MLX."""
        worker = self._worker
        with worker.lock:
            worker.dead = True
            worker.state = _CLOSED
            leftovers = _drain(worker.queue)
        # Open streams first: a consumer woken by its error finds its
        # generator closed (its ``finally`` has run) and counted.
        for stream in list(worker.open_streams):
            stream.close_on_thread(
                MLXThreadClosedError(
                    f"MLX thread {self.name!r} was shut down while this stream"
                    " was open."
                )
            )
        # Then what waited for a key: it never starts.
        waited = worker.take_waiting()
        for item in leftovers + waited:
            if item is not _STOP:
                if item.counted:
                    with worker.lock:
                        worker.discarded_count += 1
                if worker.cancel_running and isinstance(item, FutureCall):
                    item.cancel_queued()  # as shutdown(cancel_futures=True) does
                    continue
                # One error each: consumers on different threads must not
                # raise (and extend the traceback of) the same object.
                own = type(error)(*error.args)
                own.__cause__ = cause
                item.abandon(own)
        try:
            if self._finalizer is not None and worker.broken is None:
                self._finalizer()
        finally:
            if self._mlx_stream is not None:
                self._mlx_stream.close()

    def _forked(self) -> None:
        """In a forked child: this thread does not exist there."""
        worker = self._worker
        worker.lock = threading.RLock()
        worker.queue = SimpleQueue()
        if worker.state is _RUNNING:
            worker.broken = RuntimeError("the process forked")
            worker.dead = True
            worker.state = _CLOSED


def _drain(queue: SimpleQueue[Any]) -> list[Any]:
    # The worker may take the last item between a check and a get: no empty().
    items: list[Any] = []
    try:
        while True:
            items.append(queue.get_nowait())
    except Empty:
        return items


def _job_name(fn: Callable[..., object] | str) -> str:
    return fn if isinstance(fn, str) else job_name(fn)


def cancel_requested() -> bool:
    """Whether the job running on this thread should stop early.

    True once its caller was cancelled, its stream was closed, or the thread
    is shutting down with ``cancel_futures=True``. Always false elsewhere.
    """
    owner: _Worker | None = getattr(_jobs.thread_local, "owner", None)
    if owner is None:
        return False
    job = owner.running
    return owner.cancel_running or (job is not None and bool(job.cancel_requested))


_all_threads: weakref.WeakSet[MLXThread] = weakref.WeakSet()
_exit_hook_registered = False
_default: MLXThread | None = None
_default_lock = threading.Lock()


def current_default_mlx_thread() -> MLXThread:
    """The process-wide default :class:`MLXThread`, created on first use.

    A new one replaces it if it was shut down; after ``os.fork()`` the child
    gets a fresh one.
    """
    global _default
    thread = _default
    if thread is None or thread.closed:
        with _default_lock:
            thread = _default
            if thread is None or thread.closed:
                thread = _default = MLXThread(name="mlx-pinned-default")
    return thread


def _register_exit_hook() -> None:
    # threading's own exit hooks run before non-daemon threads are joined;
    # atexit runs after, too late to stop a worker (concurrent.futures does
    # the same).
    global _exit_hook_registered
    if not _exit_hook_registered:
        threading._register_atexit(_shutdown_all)  # type: ignore[attr-defined]
        _exit_hook_registered = True


def _shutdown_all() -> None:
    for thread in list(_all_threads):
        thread.shutdown(wait=True)


def _after_fork_in_child() -> None:
    global _default, _default_lock, _exit_hook_registered
    _default, _default_lock = None, threading.Lock()
    _exit_hook_registered = False
    for thread in list(_all_threads):
        thread._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
