"""Exclusive: the handle for work on an MLX thread that holds an exclusive key.

Caller side, as :class:`~mlx_pinned._submitter.Submitter`; the key rules are
kept on the worker thread by :class:`~mlx_pinned._keys.ExclusiveKeys`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar

from ._keys import Identity, hashable, user_key
from ._submitter import Submitter

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._executor import MLXThread
    from ._jobs import Call
    from ._streams import Stream

T = TypeVar("T")


class Exclusive(Submitter):
    """Work on one MLXThread that never overlaps other work with the same key.

    Returned by :meth:`MLXThread.exclusive`; it has the thread's ``submit``,
    ``run``, ``run_sync``, ``iterate`` and ``iterate_sync``, with the same
    signatures, and runs on the same thread. On that thread, work that
    shares a key never overlaps: a job holds its key while it runs, a stream
    from its first turn until its generator ends or is closed. Keyed work
    whose key is held waits, first in first out per key, while work with no
    key or another key still runs between the holder's items. A call from a
    job that holds the key, on the thread itself, runs inline.

    Waiting work counts against ``max_pending`` and is listed in
    ``statistics().waiting_for_key``. Cancelled while waiting, it never
    starts and its caller is released at once; still waiting when the
    thread stops, it ends with :class:`MLXThreadClosedError` (a future from
    ``submit`` is cancelled under ``shutdown(cancel_futures=True)``).

    Attributes:
        key: the key, as given.
        thread: the MLXThread the work runs on.
    """

    __slots__ = ("_key", "_worker", "thread")

    def __init__(self, thread: MLXThread, key: object) -> None:
        self.thread = thread
        self._worker = thread._worker
        # Compared by equality when hashable (a name), else by identity (an
        # nn.Module is a dict, so it is unhashable).
        self._key = key if hashable(key) else Identity(key)

    @property
    def key(self) -> object:
        return user_key(self._key)

    def __repr__(self) -> str:
        return f"<Exclusive {self.key!r} on {self.thread!r}>"

    def is_current(self) -> bool:
        return threading.get_ident() == self._worker.ident

    def _enqueue(self, item: Call[Any] | Stream[Any]) -> None:
        self.thread._enqueue(item)

    def _call_inline(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        self._worker.check_inline(self._key)
        return self.thread._call_inline(fn, args, kwargs)
