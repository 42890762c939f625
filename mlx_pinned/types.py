"""The types mlx-pinned's functions return: for annotations, never built by hand.

``@on_mlx_thread`` makes an :class:`MLXFunction` (or one of its kin),
``MLXThread.iterate`` an :class:`AsyncStreamIterator`, ``CHECKPOINT`` is a
:class:`Checkpoint`, ``statistics()`` an
:class:`MLXThreadStatistics`, ``mlx_lifespan()`` an :class:`MLXLifespan`.
Import them from here to annotate your own code; the concepts themselves are
in :mod:`mlx_pinned`. Nothing here runs code: the objects' docstrings say
which thread each method runs on.
"""

from __future__ import annotations

from ._async_streams import AsyncBatchIterator as AsyncBatchIterator
from ._async_streams import AsyncStreamIterator as AsyncStreamIterator
from ._decorators import MLXFunction as MLXFunction
from ._decorators import MLXGeneratorFunction as MLXGeneratorFunction
from ._decorators import MLXGeneratorMethod as MLXGeneratorMethod
from ._decorators import MLXMethod as MLXMethod
from ._lifespan import MLXLifespan as MLXLifespan
from ._statistics import MLXThreadStatistics as MLXThreadStatistics
from ._streams import Checkpoint as Checkpoint
from ._sync_streams import SyncBatchIterator as SyncBatchIterator
from ._sync_streams import SyncStreamIterator as SyncStreamIterator

__all__ = [
    "AsyncBatchIterator",
    "AsyncStreamIterator",
    "Checkpoint",
    "MLXFunction",
    "MLXGeneratorFunction",
    "MLXGeneratorMethod",
    "MLXLifespan",
    "MLXMethod",
    "MLXThreadStatistics",
    "SyncBatchIterator",
    "SyncStreamIterator",
]
