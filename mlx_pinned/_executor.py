"""MLXThread: an executor that owns one OS thread and that thread's MLX stream.

Its public methods run on the caller's thread, any thread (the ways to hand
it work are in :mod:`._submitter`, its snapshot in :mod:`._statistics`);
``_work`` and ``_finish`` run on the MLX thread it starts. The hooks at the
bottom run at interpreter exit (before threads are joined) and in a forked
child.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from concurrent.futures import Executor
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, TypeVar

from ._closing import AsyncClosing
from ._exceptions import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
)
from ._exclusive import Exclusive
from ._jobs import FutureCall
from ._mlx import ThreadStream, evaluate
from ._statistics import take_statistics
from ._submitter import Submitter
from ._worker import CLOSED, NEW, RUNNING, STOP, Worker, drain

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._jobs import Call
    from ._statistics import MLXThreadStatistics
    from ._streams import Stream

T = TypeVar("T")


class MLXThread(AsyncClosing, Submitter, Executor):
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
        self._worker = Worker(name, eval_results)
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
            if worker.state is RUNNING:
                return
            if worker.state is CLOSED:
                raise worker.closed_error()
            try:
                _register_exit_hook()
            except RuntimeError:  # the interpreter is already shutting down
                worker.state = CLOSED
                raise MLXThreadClosedError(
                    f"MLX thread {self.name!r} cannot start: the interpreter is"
                    " shutting down."
                ) from None
            thread = threading.Thread(target=self._work, name=self.name)
            thread.start()
            self._thread, worker.ident, worker.state = thread, thread.ident, RUNNING

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
            if worker.state is NEW:
                worker.state = CLOSED
                return
            if worker.state is RUNNING:
                worker.state = CLOSED
                if cancel_futures:
                    worker.cancel_running = True
                    discarded = self._take_queued()
                worker.queue.put(STOP)
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

    # The blocks start the thread; on the way out, Executor's __exit__ calls
    # shutdown(wait=True) and AsyncClosing's __aexit__ awaits aclose().
    def __enter__(self) -> Self:
        self.start()
        return self

    async def __aenter__(self) -> Self:
        self.start()
        return self

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
        return take_statistics(self._worker, self.max_pending)

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
        if worker.state is NEW:
            self.start()
        with worker.lock:
            if worker.state is not RUNNING or worker.dead:
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
        for item in drain(worker.queue):
            if item is STOP:
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
        """The worker thread: set up, serve the queue, then clean up."""
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
        try:
            worker.serve(self._mlx_stream.adopt_module_streams)
        finally:
            self._finish(
                MLXThreadClosedError(f"MLX thread {self.name!r} was shut down."), None
            )

    def _finish(self, error: BaseException, cause: BaseException | None) -> None:
        """End every job still queued, close open streams, then clean up MLX."""
        self._worker.end_all(error, cause)
        try:
            if self._finalizer is not None and self._worker.broken is None:
                self._finalizer()
        finally:
            if self._mlx_stream is not None:
                self._mlx_stream.close()

    def _forked(self) -> None:
        """In a forked child: this thread does not exist there."""
        worker = self._worker
        worker.lock = threading.RLock()
        worker.queue = SimpleQueue()
        if worker.state is RUNNING:
            worker.broken = RuntimeError("the process forked")
            worker.dead = True
            worker.state = CLOSED


_all_threads: weakref.WeakSet[MLXThread] = weakref.WeakSet()
_exit_hook_registered = False


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
    global _exit_hook_registered
    _exit_hook_registered = False
    for thread in list(_all_threads):
        thread._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
