"""Generations run inline: the loop's turns on the calling thread.

For tests that step a batch by hand (on the MLX thread, or any one thread
for a model no loop runs): :func:`generate_inline` runs the engine's loop's
turns itself while its row has no output, and routes every turn's outputs
to each inline request's own queue. Re-exported by :mod:`.kit`; imported
by ``sharded_run.py``, which runs as a script.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

from mlx_pinned.server.engine import BatchEngine
from mlx_pinned.server.engine.answers import Item, Outputs, Request
from mlx_pinned.server.engine.loop import BatchLoop
from mlx_pinned.server.events import (
    Event,
    FinalEvent,
    GenerationParams,
    PromptProgress,
)

__all__ = ["generate_inline"]


class _Inline:
    """One loop's inline requests and their items."""

    def __init__(self, loop: BatchLoop) -> None:
        self.loop = loop
        self.items: dict[Request, deque[Item]] = {}

    def route(self, outputs: Outputs) -> None:
        for request, items, _ in outputs:
            if request in self.items:
                events = (i for i in items if not isinstance(i, PromptProgress))
                self.items[request].extend(events)


_inline: weakref.WeakKeyDictionary[BatchLoop, _Inline] = weakref.WeakKeyDictionary()


def generate_inline(
    engine: BatchEngine, params: GenerationParams, images: Sequence[Any] = ()
) -> Generator[Event, None, None]:
    """A generation batched with the others, on the calling thread: while
    its row has no output, the loop's turns run here. Closing the generator
    takes its row out at once; the other rows go on."""
    inline = _inline.setdefault(engine.loop, _Inline(engine.loop))
    request = Request(params, images)
    queue = inline.items[request] = deque()
    inline.loop.submit(request)
    try:
        while True:
            while not queue:
                inline.route(inline.loop.turn())
            item = queue.popleft()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, FinalEvent):
                return
    finally:
        if not request.ended:
            inline.loop.leave(request)
            inline.route(inline.loop.take_commands())
        del inline.items[request]
