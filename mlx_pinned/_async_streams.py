"""Async iterators over a stream (see :mod:`._streams`), for event loops.

Their methods run on the consumer's event loop (asyncio or trio), never on
the MLX thread: they take what the worker has read ahead and, when there is
nothing yet, wait for the worker's wake-up without blocking the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from ._closing import AsyncClosing
from ._waiters import async_waiter

if TYPE_CHECKING:
    import sys
    from collections.abc import Callable

    from ._streams import Stream

    if sys.version_info >= (3, 11):
        from typing import Self
    else:  # pragma: no cover
        from typing_extensions import Self

T = TypeVar("T")
V = TypeVar("V")  # what one take gives: an item, or a batch of them


class AsyncStreamIterator(AsyncClosing, Generic[T]):
    """An async iterator over a generator that runs on an MLXThread.

    Returned by :meth:`MLXThread.iterate`. ``aclose()`` (or cancelling the
    consumer, or dropping the iterator) closes the generator on the thread
    before its next item. :meth:`batched` takes the items in batches.
    """

    __slots__ = ("__weakref__", "_cancelled", "_stream")

    def __init__(self, stream: Stream[T]) -> None:
        self._stream = stream
        self._cancelled = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        item = await self._next(self._stream.take)
        return item  # type: ignore[return-value]

    def read_ahead(self, n: int) -> None:
        """Let the thread read up to ``n`` items ahead of the consumer (2 by
        default), so a consumer that is busy for a while does not hold the
        generator up; each item still wakes a waiting consumer. Call it
        before the first item is taken.

        Raises:
            ValueError: ``n`` is less than 1.
        """
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        self._stream.read_ahead(n)

    def batched(self, n: int) -> AsyncBatchIterator[T]:
        """The items in tuples of ``n`` (the last may be shorter), as
        :func:`itertools.batched` groups them.

        The thread reads up to ``n`` items ahead and wakes the consumer once
        per batch, not once per item: for a consumer that needs the items
        together (a response sent whole), not as soon as each is made. If the
        generator raises, the items made before the error come first, then
        the error. Closing either iterator closes the generator.

        Raises:
            ValueError: ``n`` is less than 1.
        """
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        self._stream.batch_mode(n)
        return AsyncBatchIterator(self)

    async def _next(self, take: Callable[[], tuple[bool, V]]) -> V:
        """What ``take`` (``Stream.take`` or ``take_batch``) gives next,
        waiting while it has nothing."""
        while True:
            try:
                ready, value = take()
            except StopIteration:
                raise StopAsyncIteration from None
            if ready:
                return value
            await self._wait()

    async def _wait(self) -> None:
        """Wait until there is something to take (or the stream ended)."""
        stream = self._stream
        waiter = async_waiter()
        if stream.set_waiter(waiter):
            try:
                await waiter.wait()
            except BaseException:
                stream.request_close()  # cancelled: stop the generator
                # asyncio delivers a cancellation once: an aclose() that
                # follows (contextlib.aclosing) must not wait again.
                self._cancelled = True
                raise

    async def aclose(self) -> None:
        """Close the generator on the thread and wait until it is closed.

        After the consumer was cancelled, only asks for the close (queued on
        the thread) and returns at once, so a cancelled task is released.
        """
        stream = self._stream
        if stream.request_close() and not self._cancelled:
            while True:
                waiter = async_waiter()
                if not stream.set_waiter(waiter):
                    return
                await waiter.wait()

    def __del__(self) -> None:
        self._stream.request_close()


class AsyncBatchIterator(AsyncClosing, Generic[T]):
    """The items of an :class:`AsyncStreamIterator` in tuples; from
    :meth:`AsyncStreamIterator.batched`. ``aclose()`` closes the generator."""

    __slots__ = ("_items",)

    def __init__(self, items: AsyncStreamIterator[T]) -> None:
        self._items = items  # keeps it alive: dropping it closes the stream

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[T, ...]:
        items = self._items
        return await items._next(items._stream.take_batch)

    async def aclose(self) -> None:
        """Close the generator on the thread and wait until it is closed."""
        await self._items.aclose()
