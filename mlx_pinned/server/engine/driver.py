"""The engine's event-loop side: the loop's driver and each request's output.

The one part of the engine that runs on the event loop (asyncio or trio,
through anyio); it touches no MLX. The loop (:mod:`.loop`) runs on the MLX
thread as one ``MLXThread.iterate`` stream whose items are its turns'
outputs; its driver, a task of the event loop (:func:`spawn`), puts each
output in the :class:`~.outputs.RowOutput` of its request, which the
request's :class:`~..events.EventStream` reads
(:class:`~.outputs.RowStream`). A slow reader never holds the loop: its
events wait in its own output.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, cast

import sniffio

from ..events import EventStream, GenerationParams
from .answers import Outputs, Request
from .outputs import RowOutput, RowStream

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread
    from mlx_pinned.types import AsyncStreamIterator

    from .loop import BatchLoop

__all__ = ["READ_AHEAD", "LoopDriver", "spawn"]


logger = logging.getLogger("mlx_pinned.server")

# Turns the loop may run ahead of its driver: a busy event loop never holds
# the batch up, and a driver that went away stops it soon.
READ_AHEAD = 64

_tasks: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references


def spawn(fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Run ``fn(*args)`` as a task of the running event loop that outlives
    its caller (the loop's driver serves every request, not the one that
    started it). Event loop only."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn, *args)
        return
    task = asyncio.get_running_loop().create_task(fn(*args))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


class LoopDriver:
    """The event-loop side of a model's loop (:class:`~.loop.BatchLoop`):
    requests submit and close here, and the driver task routes the loop's
    outputs. Event loop only, but :meth:`close` (any thread).

    Args:
        loop: The model's loop.
        thread: The MLX thread the loop runs on.
    """

    def __init__(self, loop: BatchLoop, thread: MLXThread) -> None:
        self.loop = loop
        self.thread = thread
        self._live: set[Request] = set()  # submitted, not yet gone
        self._driving = False  # a driver task follows the loop's stream

    def stream(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> EventStream:
        """Submit a generation; its events. The loop is started here when it
        is not running (its driver is a task of this event loop).

        Raises:
            MLXThreadClosedError: The thread is closed (raised here, at once).
            MLXThreadBusyError: The thread's queue is full.
        """
        request = Request(params, images, RowOutput())
        self.loop.submit(request)
        if not self._driving:
            try:
                items = self._start()
            except BaseException:
                request.ended = True  # the loop skips its admission
                raise
            spawn(self._drive, items)
        self._live.add(request)
        return EventStream(RowStream(self, request))

    def close(self, request: Request) -> bool:
        """Take ``request``'s row out at the loop's next turn; any thread.
        Whether the loop holds it still (its output then says when it left)."""
        if request.ended:
            return False
        self.loop.leave(request)
        return True

    def whole(self, request: Request) -> None:
        """``request``'s reader takes its answer whole: the loop hands its
        events out in one output, when it ended."""
        self.loop.whole(request)

    def _start(self) -> AsyncStreamIterator[tuple[Outputs, bool]]:
        # The loop's checkpoints are no items: the stream carries outputs.
        items = cast(
            "AsyncStreamIterator[tuple[Outputs, bool]]",
            self.thread.iterate(self.loop.run),
        )
        items.read_ahead(READ_AHEAD)
        self._driving = True
        return items

    async def _drive(self, items: AsyncStreamIterator[tuple[Outputs, bool]]) -> None:
        """Route the loop's outputs until it ends, starting it again while
        commands came meanwhile; if it breaks (the thread closed under it),
        fail every request."""
        try:
            while True:
                last: Outputs = []
                async with items:
                    async for outputs, ended in items:
                        if ended:
                            last = outputs
                        else:
                            self._route(outputs)
                self._route(last)
                # No await from here to the end: a submission sees the flag.
                if not self.loop.waiting():
                    self._driving = False
                    return
                items = self._start()
        except BaseException as exc:
            self._driving = False
            self._fail_live(exc)
            if not isinstance(exc, Exception):
                raise  # cancelled: the event loop is going away
            logger.debug("the batch's loop stopped", exc_info=True)

    def _route(self, outputs: Outputs) -> None:
        for request, items, gone in outputs:
            assert request.output is not None
            request.output.put(items, gone=gone)
            if gone:
                self._live.discard(request)

    def _fail_live(self, error: BaseException) -> None:
        """Fail every request still live: the loop's driver broke."""
        if not isinstance(error, Exception):
            error = RuntimeError("the batch's loop was cancelled")
        failed, self._live = self._live, set()
        for request in failed:
            request.ended = True
            assert request.output is not None
            request.output.put((error,), gone=True)
