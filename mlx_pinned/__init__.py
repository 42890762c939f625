"""mlx-pinned: one pinned MLX thread for async servers.

MLX streams are thread-local: a model loaded on one thread cannot be run on
another. :class:`MLXThread` owns one thread and its stream and runs every job
there; :func:`on_mlx_thread` makes a function run on it; :func:`mlx_lifespan`
and the middleware tie it to an ASGI app's lifespan. The types these return,
for annotations, are in :mod:`mlx_pinned.types`.
"""

from __future__ import annotations

from ._decorators import on_mlx_thread as on_mlx_thread
from ._default import current_default_mlx_thread as current_default_mlx_thread
from ._exceptions import BlockingCallWarning as BlockingCallWarning
from ._exceptions import MLXPinnedError as MLXPinnedError
from ._exceptions import MLXPinnedWarning as MLXPinnedWarning
from ._exceptions import MLXThreadBrokenError as MLXThreadBrokenError
from ._exceptions import MLXThreadBusyError as MLXThreadBusyError
from ._exceptions import MLXThreadClosedError as MLXThreadClosedError
from ._exceptions import MLXThreadDeadlockError as MLXThreadDeadlockError
from ._exceptions import SharedModelWarning as SharedModelWarning
from ._exceptions import ShuttingDownError as ShuttingDownError
from ._exceptions import StreamAffinityError as StreamAffinityError
from ._exclusive import Exclusive as Exclusive
from ._executor import MLXThread as MLXThread
from ._lifespan import mlx_lifespan as mlx_lifespan
from ._streams import CHECKPOINT as CHECKPOINT
from ._worker import cancel_requested as cancel_requested

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINT",
    "BlockingCallWarning",
    "Exclusive",
    "MLXPinnedError",
    "MLXPinnedWarning",
    "MLXThread",
    "MLXThreadBrokenError",
    "MLXThreadBusyError",
    "MLXThreadClosedError",
    "MLXThreadDeadlockError",
    "SharedModelWarning",
    "ShuttingDownError",
    "StreamAffinityError",
    "__version__",
    "cancel_requested",
    "current_default_mlx_thread",
    "mlx_lifespan",
    "on_mlx_thread",
]
