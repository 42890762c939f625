"""Exclusive keys: the bookkeeping that keeps work sharing a key from
overlapping on one MLX thread.

:class:`ExclusiveKeys` is part of the worker: its tables are read and written
on the worker thread only; ``sweep`` queues a turn from any thread.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any

from ._exceptions import MLXThreadDeadlockError

if TYPE_CHECKING:
    from concurrent.futures import Future
    from queue import SimpleQueue

    from ._jobs import Running
    from ._worker import Worker


class ExclusiveKeys:
    """The exclusive keys of a worker: the job or stream that holds each
    key, the work waiting for it (FIFO), and the work handed a key that was
    let go, which runs before the next queued item."""

    __slots__ = ("holders", "ready", "waiting")
    # The worker's own members that the key tables work with.
    lock: threading.RLock
    queue: SimpleQueue[Any]
    dead: bool
    name: str
    running: Running | None

    def __init__(self) -> None:
        self.holders: dict[object, Running] = {}
        self.waiting: dict[object, deque[Any]] = {}
        self.ready: deque[Any] = deque()

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether the worker was shut down or broke."""

    def sweep(self, key: object) -> None:
        with self.lock:
            if not self.dead:
                self.queue.put(Sweep(key))

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
        waiting = None if self.closed else self.waiting.get(key)
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

    def take_waiters_that_left(self, key: object) -> list[Any]:
        """Remove and return the work waiting for ``key`` whose caller left
        (cancelled, or its stream closed), to be ended now instead of once
        the key is free."""
        waiting = self.waiting.get(key)
        if not waiting:
            return []
        left = [item for item in waiting if item.fn is None or item.cancel_requested]
        if not left:
            return []
        staying = deque(item for item in waiting if item not in left)
        if staying:
            self.waiting[key] = staying
        else:
            del self.waiting[key]
        return [item for item in left if item.fn is not None]

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
                f" exclusive key {user_key(key)!r} is held by another open job"
                " or stream, and waiting for it here would wait forever; queue"
                " it with submit() and do not wait for it on the thread."
            )


class Identity:
    """An unhashable key, compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.value is self.value


def hashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def user_key(key: object) -> object:
    return key.value if isinstance(key, Identity) else key


class Sweep:
    """A queue item: end the work waiting for ``swept`` whose caller left."""

    __slots__ = ("swept",)
    counted = False  # never refused, never counted as pending
    key = None  # holds no key itself
    fn = None

    def __init__(self, swept: object) -> None:
        self.swept = swept

    def run(self, worker: Worker) -> None:
        worker.end_waiters_that_left(self.swept)

    def abandon(self, error: BaseException) -> None:
        """Nothing waits on a sweep."""


def sweep_if_cancelled(worker: Worker, key: object, future: Future[Any]) -> None:
    if future.cancelled():
        worker.sweep(key)
