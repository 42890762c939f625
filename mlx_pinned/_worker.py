"""The worker of an MLXThread: its queue, lock, state and counters, and the
worker thread's main loop.

``serve`` and ``end_all`` run on the worker thread; what else may run where
is said on :class:`Worker`.
"""

from __future__ import annotations

import threading
import time
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any

from . import _jobs
from ._exceptions import MLXThreadBrokenError, MLXThreadClosedError
from ._jobs import FutureCall
from ._keys import ExclusiveKeys
from ._mlx import affinity_error, is_stream_error, job_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._jobs import Running
    from ._streams import Stream

STOP = object()  # the queue item that ends the main loop
# The worker's states, in the order it moves through them.
NEW, RUNNING, CLOSED = "new", "running", "closed"


class Worker(ExclusiveKeys):
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
        "ident",
        "lock",
        "name",
        "open_streams",
        "queue",
        "running",
        "started_count",
        "state",
        "submitted_count",
    )

    def __init__(self, name: str, eval_results: bool) -> None:
        self.name = name
        self.eval_results = eval_results
        # Reentrant: a stream iterator collected while the worker holds the
        # lock (garbage collection can run anywhere) queues its close turn.
        self.lock = threading.RLock()
        self.queue: SimpleQueue[Any] = SimpleQueue()
        self.state = NEW
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
        super().__init__()  # the exclusive keys

    @property
    def closed(self) -> bool:
        return self.state is CLOSED or self.broken is not None

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

    def end_waiters_that_left(self, key: object) -> None:
        """End the work waiting for ``key`` whose caller left (cancelled, or
        its stream closed) now, instead of once the key is free."""
        for item in self.take_waiters_that_left(key):
            if item.counted:
                self.started_count += 1
            item.run(self)  # it sees it was cancelled or closed, and ends

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
                f"job {job_name(fn)!r} raised StopIteration"
            )
        elif is_stream_error(error):
            new = affinity_error(error, fn, args, kwargs, self.name)
        else:
            return error
        new.__cause__ = error
        new.__traceback__ = error.__traceback__
        return new

    def serve(self, adopt: Callable[[], None]) -> None:
        """The main loop, until ``STOP``: run each item in turn, keyed work
        once it holds its key. ``adopt`` runs before each item."""
        _jobs.thread_local.owner = self
        queue = self.queue
        get_nowait = queue.get_nowait
        ready, admit, let_go = self.ready, self.admit, self.let_go
        clock = time.perf_counter
        self.busy_since = clock()
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
                        self.busy_time += clock() - self.busy_since
                        self.busy_since = None
                        item = queue.get()
                        self.busy_since = clock()
                if item is STOP:
                    break
                key = item.key
                if key is not None and not admit(item):
                    continue  # it waits for its key
                if item.counted:
                    self.started_count += 1
                adopt()
                item.run(self)
                if key is not None and item.fn is None:  # it ended
                    let_go(item)
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            self.broken = exc
            raise
        finally:
            if self.busy_since is not None:
                self.busy_time += clock() - self.busy_since
                self.busy_since = None

    def end_all(self, error: BaseException, cause: BaseException | None) -> None:
        """End every item still queued or waiting for a key with a copy of
        ``error``, and close the open streams (the worker's last act)."""
        with self.lock:
            self.dead = True
            self.state = CLOSED
            leftovers = drain(self.queue)
        # Open streams first: a consumer woken by its error finds its
        # generator closed (its ``finally`` has run) and counted.
        for stream in list(self.open_streams):
            stream.close_on_thread(
                MLXThreadClosedError(
                    f"MLX thread {self.name!r} was shut down while this stream"
                    " was open."
                )
            )
        # Then what waited for a key: it never starts.
        waited = self.take_waiting()
        for item in leftovers + waited:
            if item is not STOP:
                if item.counted:
                    with self.lock:
                        self.discarded_count += 1
                if self.cancel_running and isinstance(item, FutureCall):
                    item.cancel_queued()  # as shutdown(cancel_futures=True) does
                    continue
                # One error each: consumers on different threads must not
                # raise (and extend the traceback of) the same object.
                own = type(error)(*error.args)
                own.__cause__ = cause
                item.abandon(own)


def drain(queue: SimpleQueue[Any]) -> list[Any]:
    """Remove and return every item of ``queue``."""
    # The worker may take the last item between a check and a get: no empty().
    items: list[Any] = []
    try:
        while True:
            items.append(queue.get_nowait())
    except Empty:
        return items


def cancel_requested() -> bool:
    """Whether the job running on this thread should stop early.

    True once its caller was cancelled, its stream was closed, or the thread
    is shutting down with ``cancel_futures=True``. Always false elsewhere.
    """
    owner: Worker | None = getattr(_jobs.thread_local, "owner", None)
    if owner is None:
        return False
    job = owner.running
    return owner.cancel_running or (job is not None and bool(job.cancel_requested))
