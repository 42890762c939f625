"""Blocking iterators over a stream (see :mod:`._streams`).

Their methods run on the consumer's thread: any thread but the MLX thread,
where waiting for the stream would wait for itself (refused at once). On an
event loop's thread they work but warn, since they block the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from ._closing import Closing
from ._waiters import SyncWaiter, warn_if_blocking_a_loop

if TYPE_CHECKING:
    import sys

    from ._streams import Stream

    if sys.version_info >= (3, 11):
        from typing import Self
    else:  # pragma: no cover
        from typing_extensions import Self

T = TypeVar("T")


class SyncStreamIterator(Closing, Generic[T]):
    """A blocking iterator over a generator that runs on an MLXThread.

    Returned by :meth:`MLXThread.iterate_sync`; ``close()`` (or a ``with``
    block, or dropping it) closes the generator on the thread.
    :meth:`batched` takes the items in batches.
    """

    __slots__ = ("__weakref__", "_stream")

    def __init__(self, stream: Stream[T]) -> None:
        self._stream = stream

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        stream = self._stream
        while True:
            ready, item = stream.take()
            if ready:
                return item  # type: ignore[return-value]
            self._wait()

    def batched(self, n: int) -> SyncBatchIterator[T]:
        """The items in tuples of ``n`` (the last may be shorter); see
        :meth:`AsyncStreamIterator.batched`.

        Raises:
            ValueError: ``n`` is less than 1.
        """
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        self._stream.batch_mode(n)
        return SyncBatchIterator(self)

    def _wait(self) -> None:
        stream = self._stream
        if stream.owner.is_current():
            raise RuntimeError(
                "a stream of an MLXThread cannot be consumed on that thread"
                " (it would wait for itself): call the generator directly."
            )
        warn_if_blocking_a_loop("Iterating a .sync() or iterate_sync() stream")
        waiter = SyncWaiter()
        if stream.set_waiter(waiter):
            try:
                waiter.wait()
            except BaseException:
                stream.request_close()
                raise

    def close(self) -> None:
        """Close the generator on the thread and wait until it is closed."""
        stream = self._stream
        if stream.request_close() and not stream.owner.is_current():
            while True:
                waiter = SyncWaiter()
                if not stream.set_waiter(waiter):
                    return
                waiter.wait()

    def __del__(self) -> None:
        self._stream.request_close()


class SyncBatchIterator(Closing, Generic[T]):
    """The items of a :class:`SyncStreamIterator` in tuples; from
    :meth:`SyncStreamIterator.batched`. ``close()`` closes the generator."""

    __slots__ = ("_items",)

    def __init__(self, items: SyncStreamIterator[T]) -> None:
        self._items = items  # keeps it alive: dropping it closes the stream

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> tuple[T, ...]:
        items = self._items
        stream = items._stream
        while True:
            ready, batch = stream.take_batch()
            if ready:
                return batch
            items._wait()

    def close(self) -> None:
        """Close the generator on the thread and wait until it is closed."""
        self._items.close()
