"""Streams: a sync generator advanced on the MLX thread, consumed elsewhere.

The generator is created, advanced and closed only on the worker thread, one
item per turn: after each item the stream goes to the back of the queue, so
streams interleave item by item with each other and with plain jobs. It reads
at most ``READ_AHEAD`` items ahead of its consumer, then parks until the
consumer takes one; a slow consumer never holds the thread.

This module is the state a stream's two sides share. The ``Stream`` methods
under "worker side" run on the MLX thread, those under "consumer side" on the
consumer's thread (any thread but the MLX thread, or an event loop's); what a
stream needs of its executor is :class:`StreamOwner`. The consumers' iterators
are in :mod:`._async_streams` (event loops) and :mod:`._sync_streams`
(blocking).
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar

from ._exceptions import SharedModelWarning
from ._jobs import JobOwner
from ._mlx import evaluate, job_name, models_in

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from queue import SimpleQueue

    from ._waiters import Waiter

T = TypeVar("T")

READ_AHEAD = 2


class Checkpoint:
    """The type of :data:`CHECKPOINT`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "mlx_pinned.CHECKPOINT"


#: Yielded by a generator that runs with ``MLXThread.iterate``: the turn
#: ends and other work gets the thread, but no item is produced (the
#: consumer is not woken, and nothing counts against the read-ahead).
CHECKPOINT = Checkpoint()


class _End:
    """Outcome of a stream that finished, or whose consumer closed it."""


_END = _End()


class StreamOwner(JobOwner, Protocol):
    """What a stream reads and writes of its executor, beyond a job's needs.

    ``queue``, ``open_streams`` and the job's members: on the worker thread
    only. ``requeue``, ``sweep`` and ``is_current``: from any thread.
    """

    name: str  # the MLX thread's
    # The next turn is put here directly, on the worker, while it is alive.
    queue: SimpleQueue[Any]
    open_streams: set[Stream[Any]]  # streams whose generator exists

    @property
    def closed(self) -> bool:
        """Whether the executor was shut down or broke."""
        ...

    def closed_error(self) -> BaseException:
        """The error a consumer gets once the executor is closed."""
        ...

    def requeue(self, stream: Stream[Any]) -> None:
        """Queue the stream's next turn (any thread), never refused for lack
        of room; end the stream instead if the worker is gone."""
        ...

    def sweep(self, key: object) -> None:
        """Queue a sweep of the work waiting for ``key`` (any thread): what
        was closed or cancelled while it waited ends then, not once the key
        is free."""
        ...


class Stream(Generic[T]):
    """State shared by the worker (producer) and one consumer."""

    __slots__ = (
        "args",
        "buffer",
        "close_requested",
        "counted",
        "fn",
        "gen",
        "key",
        "kwargs",
        "limit",
        "lock",
        "models",
        "outcome",
        "owner",
        "scheduled",
        "waiter",
        "wake_at",
    )

    def __init__(
        self,
        owner: StreamOwner,
        fn: Callable[..., Iterable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: object = None,
    ) -> None:
        self.owner = owner
        self.fn: Callable[..., Iterable[T]] | None = fn
        self.args = args
        self.kwargs = kwargs
        # The exclusive key it holds from its first turn until it ends, or None.
        self.key = key
        # Reentrant: garbage collection can run while a thread holds it and
        # collect this stream's iterator, whose finalizer asks for a close.
        self.lock = threading.RLock()
        self.buffer: deque[T] = deque()
        self.outcome: BaseException | _End | None = None
        self.scheduled = True  # a turn is queued or running
        self.close_requested = False
        self.counted = True  # only the first turn counts against max_pending
        self.gen: Iterator[T] | None = None
        self.waiter: Waiter | None = None
        self.limit = READ_AHEAD  # items read ahead of the consumer, at most
        self.models: tuple[object, ...] = ()  # mlx.nn.Module arguments, while open
        self.wake_at = 1  # buffered items that wake a waiting consumer

    @property
    def cancel_requested(self) -> bool:
        return self.close_requested  # cancel_requested() adds cancel_futures

    # -- worker side ---------------------------------------------------------

    def run(self, owner: StreamOwner) -> None:
        """One turn on the worker: create the generator or advance it once."""
        self.counted = False
        if self.close_requested:
            self.close_on_thread(None)
            return
        if owner.closed:
            # Shut down: a stream is never started or advanced past this
            # point; its consumer must not wait for it (shutdown never does).
            self.close_on_thread(owner.closed_error())
            return
        fn = self.fn
        owner.running = self
        item: Any = _END
        outcome: BaseException | _End | None = None
        try:
            if self.gen is None:
                self.gen = iter(fn(*self.args, **self.kwargs))  # type: ignore[misc]
                owner.open_streams.add(self)
                models = models_in(self.args, self.kwargs)
                if models:
                    self.models = models
                    _warn_if_sharing_a_model(self, owner)
            item = next(self.gen)
            if owner.eval_results and item is not CHECKPOINT:
                evaluate(item)
        except StopIteration:
            item, outcome = _END, _END
        except BaseException as exc:
            args, kwargs = self.args, self.kwargs
            item, outcome = _END, owner.translate(exc, fn, args, kwargs)  # type: ignore[arg-type]
        owner.running = None
        if outcome is not None:
            self._end_on_thread(outcome)
            return
        with self.lock:
            close = self.close_requested
            if close:  # the consumer left while we produced: drop the item
                waiter = None
            elif item is CHECKPOINT:  # no item: the next turn, at the back
                owner.queue.put(self)
                return
            else:
                buffer = self.buffer
                buffer.append(item)
                if len(buffer) < self.limit:
                    # The next turn is queued before the item can be taken: a
                    # consumer that takes it and leaves at once queues no
                    # close turn (this one is scheduled), and that close must
                    # run before any job it queues next (FIFO). The worker is
                    # alive here, so the queue is too.
                    owner.queue.put(self)
                else:
                    self.scheduled = False  # parked: take() queues its turn
                if len(buffer) >= self.wake_at:
                    waiter, self.waiter = self.waiter, None
                else:
                    waiter = None
        if close:
            self.close_on_thread(None)
            return
        if waiter is not None:
            waiter.wake()

    def _end_on_thread(self, outcome: BaseException | _End) -> None:
        owner = self.owner
        if outcome is _END:
            owner.completed_count += 1
        else:
            owner.failed_count += 1
        self._release_on_thread()
        self._settle(outcome, keep_buffer=True)

    def close_on_thread(self, error: BaseException | None) -> None:
        """Close the generator here, on the worker; ``error`` is what the
        consumer gets next (``None``: the consumer closed it itself)."""
        gen = self.gen
        self._release_on_thread()
        if gen is not None:
            close = getattr(gen, "close", None)
            try:
                if close is not None:
                    close()
            except BaseException as exc:  # a generator that refuses to close
                error = error or exc
        self.owner.cancelled_count += 1
        self._settle(_END if error is None else error, keep_buffer=False)

    def _release_on_thread(self) -> None:
        self.owner.open_streams.discard(self)
        self.gen = self.fn = None
        self.args, self.kwargs = (), {}
        self.models = ()

    def abandon(self, error: BaseException) -> None:
        """End a stream that will get no more turns (any thread)."""
        self.fn = None
        self._settle(error, keep_buffer=False)

    def _settle(self, outcome: BaseException | _End, *, keep_buffer: bool) -> None:
        with self.lock:
            if self.outcome is None:
                self.outcome = outcome
            if not keep_buffer:
                self.buffer.clear()
            self.scheduled = False
            waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.wake()

    # -- consumer side -------------------------------------------------------

    def take(self) -> tuple[bool, T | None]:
        """Take the next item if there is one: ``(True, item)``; ``(False,
        None)`` when the caller must wait. Raises at the end of the stream."""
        # Here and below, the turn marked scheduled under the lock is queued
        # in a finally: a KeyboardInterrupt landing in between (a sync
        # consumer on the main thread) would leave the generator parked, and
        # the consumer's close() waiting forever for that turn.
        requeue = False
        try:
            with self.lock:
                if self.buffer:
                    item = self.buffer.popleft()
                    if not self.scheduled and self.outcome is None:
                        self.scheduled = requeue = True
                elif self.outcome is not None:
                    self._raise_end()
                else:
                    return False, None
        finally:
            if requeue:
                self.owner.requeue(self)
        return True, item

    def _raise_end(self) -> NoReturn:
        """The stream's end, once its buffer is empty (under the lock): its
        error, else StopIteration; later takes see StopIteration."""
        outcome, self.outcome = self.outcome, _END
        if isinstance(outcome, BaseException):
            raise outcome
        raise StopIteration

    def read_ahead(self, size: int) -> None:
        """Read up to ``size`` items ahead of the consumer; each still wakes
        it (see :meth:`AsyncStreamIterator.read_ahead`)."""
        requeue = False
        try:
            with self.lock:
                self.limit = size
                if not self.scheduled and self.outcome is None:
                    self.scheduled = requeue = len(self.buffer) < self.limit
        finally:
            if requeue:
                self.owner.requeue(self)

    def batch_mode(self, size: int) -> None:
        """Read up to ``size`` items ahead; wake the consumer when ``size``
        are ready or the stream has ended (see :meth:`take_batch`)."""
        requeue = False
        try:
            with self.lock:
                self.limit = self.wake_at = size
                if not self.scheduled and self.outcome is None:
                    # Parked at the old limit: there is room again.
                    self.scheduled = requeue = len(self.buffer) < self.limit
        finally:
            if requeue:
                self.owner.requeue(self)

    def take_batch(self) -> tuple[bool, tuple[T, ...]]:
        """Take every buffered item once ``wake_at`` are ready, or what is left
        at the end: ``(True, items)``; ``(False, ())`` when the caller must
        wait. Raises at the end of the stream, once the buffer is empty."""
        requeue = False
        try:
            with self.lock:
                buffer = self.buffer
                ready = len(buffer) >= self.wake_at
                if ready or (buffer and self.outcome is not None):
                    if len(buffer) <= self.wake_at:
                        items = tuple(buffer)
                        buffer.clear()
                    else:  # more than a batch was read ahead before batch_mode()
                        items = tuple(buffer.popleft() for _ in range(self.wake_at))
                    if not self.scheduled and self.outcome is None:
                        self.scheduled = requeue = True
                elif self.outcome is not None:
                    self._raise_end()
                else:
                    return False, ()
        finally:
            if requeue:
                self.owner.requeue(self)
        return True, items

    def set_waiter(self, waiter: Waiter) -> bool:
        """Register ``waiter`` unless there is already something to take
        (``wake_at`` items, or the end).

        Also how ``aclose``/``close`` wait: once a close is requested the
        buffer stays empty, so only the outcome ends the wait.
        """
        with self.lock:
            if len(self.buffer) >= self.wake_at or self.outcome is not None:
                return False
            self.waiter = waiter
            return True

    def request_close(self) -> bool:
        """Ask the worker to close the generator; ``True`` if it is still open."""
        requeue = sweep = False
        try:
            with self.lock:
                if self.outcome is not None:
                    self.buffer.clear()
                    return False
                self.close_requested = True
                self.buffer.clear()
                requeue = not self.scheduled
                # A turn is queued, running, or waiting for the key: only in
                # the last case does it need a sweep to end before the key
                # is free, and only the worker knows which case it is.
                sweep = not requeue and self.key is not None
                self.scheduled = True
        finally:
            if requeue:
                self.owner.requeue(self)
            elif sweep:
                self.owner.sweep(self.key)
        return True


def _warn_if_sharing_a_model(stream: Stream[Any], owner: StreamOwner) -> None:
    """Warn if another open stream got one of ``stream``'s models and shares
    no key with it (on the worker, as ``stream`` starts: never per item)."""
    for other in owner.open_streams:
        if other is stream or (stream.key is not None and stream.key == other.key):
            continue
        shared = [model for model in stream.models if _among(model, other.models)]
        if shared:
            first, second = job_name(other.fn), job_name(stream.fn)
            streams = (
                f"Two streams of {first!r} are"
                if first == second
                else f"Streams {first!r} and {second!r} are"
            )
            warnings.warn(
                f"{streams} open at once on MLX thread {owner.name!r} with the"
                f" same model ({type(shared[0]).__name__}) and no shared exclusive"
                " key, so their items interleave: a model that keeps request"
                " state on itself (as mlx-vlm's Qwen-VL family does) then gives"
                " wrong answers. Give both the same key: exclusive=model.",
                SharedModelWarning,
                stacklevel=2,
            )
            return


def _among(model: object, models: tuple[object, ...]) -> bool:
    return any(model is other for other in models)
