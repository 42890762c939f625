"""The process-wide default MLXThread, and the lifespans that hold it.

Any thread may call these; the lock guards only the replacement of a default
that closed, so the common call reads one global.
"""

from __future__ import annotations

import os
import threading

from ._executor import MLXThread

_default: MLXThread | None = None
_default_lock = threading.Lock()
# How many lifespans hold each default thread (see hold_default_mlx_thread).
_default_holds: dict[MLXThread, int] = {}


def current_default_mlx_thread() -> MLXThread:
    """The process-wide default :class:`MLXThread`, created on first use.

    A new one replaces it if it was shut down; after ``os.fork()`` the child
    gets a fresh one.
    """
    thread = _default
    if thread is None or thread.closed:
        with _default_lock:
            thread = _live_default()
    return thread


def _live_default() -> MLXThread:
    """The default thread, a new one if there is none or it closed (under
    ``_default_lock``)."""
    global _default
    thread = _default
    if thread is None or thread.closed:
        thread = _default = MLXThread(name="mlx-pinned-default")
    return thread


def hold_default_mlx_thread() -> MLXThread:
    """The default thread, held by one more lifespan until it calls
    :func:`release_default_mlx_thread` (the middleware, without ``thread=``)."""
    with _default_lock:
        thread = _live_default()
        _default_holds[thread] = _default_holds.get(thread, 0) + 1
    return thread


def release_default_mlx_thread(thread: MLXThread) -> bool:
    """One lifespan lets go of ``thread``, from :func:`hold_default_mlx_thread`:
    whether it was the last, which then shuts it down (the next use of the
    default starts a fresh one)."""
    with _default_lock:
        left = _default_holds.pop(thread, 1) - 1
        if left > 0:
            _default_holds[thread] = left
    return left <= 0


def _after_fork_in_child() -> None:
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()
    _default_holds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
