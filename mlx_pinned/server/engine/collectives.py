"""Rank 0's messages to the other ranks, through ``mx.distributed``, watched.
:class:`Channel` sends one in two ``all_sum`` collectives, as mlx-lm's
distributed server shares its requests; a collective has no timeout, so
:class:`Watchdog` (a thread of its own) bounds each wait. The collectives
run on the MLX thread, but rank 0's stop message.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["Channel", "Watchdog"]

logger = logging.getLogger("mlx_pinned.server")


class Channel:
    """Messages from rank 0 to every rank of ``group``, with a number from each
    rank back. Every rank must call :meth:`exchange` alike, in order."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()

    def exchange(self, message: bytes | None, report: int) -> tuple[bytes, list[int]]:
        """Send ``message`` (rank 0) or receive it (the others, None), with this
        rank's ``report`` for rank 0.

        Returns:
            The message, and each rank's report, rank 0 first.

        Raises:
            RuntimeError: The backend's error for a rank that is gone.
        """
        header = np.zeros((self.size, 2), dtype=np.int32)
        header[self.rank] = (len(message) if message is not None else 0, report)
        summed = self._all_sum(header)
        size = int(summed[0, 0])
        reports = [int(value) for value in summed[:, 1]]
        if size == 0:
            return b"", reports
        if message is not None:
            data = np.frombuffer(message, dtype=np.uint8)
        else:
            data = np.zeros(size, dtype=np.uint8)
        return self._all_sum(data).tobytes(), reports

    def _all_sum(self, values: np.ndarray) -> np.ndarray:
        total = mx.distributed.all_sum(
            mx.array(values), group=self.group, stream=mx.cpu
        )
        # mx.eval lets go of the GIL while it waits for the other ranks: the
        # watchdog and the event loop run meanwhile.
        mx.eval(total)
        return np.array(total)


class Watchdog:
    """Bounds how long a section of one thread may run (one at a time). ``tick``
    runs every ``interval`` seconds on the watchdog's thread; ``on_timeout``
    once, there, with what ran late, and the watchdog stops."""

    def __init__(
        self,
        on_timeout: Callable[[str], None],
        *,
        interval: float = 0.1,
        tick: Callable[[], None] | None = None,
    ) -> None:
        self._on_timeout = on_timeout
        self._interval = interval
        self._tick = tick
        self._section: tuple[str, float, float] | None = None  # what, limit, end
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="mlx-pinned-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (a section still open is no longer bounded)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @contextlib.contextmanager
    def watch(self, what: str, seconds: float) -> Iterator[None]:
        self._section = (what, seconds, time.monotonic() + seconds)
        try:
            yield
        finally:
            self._section = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            section = self._section
            if section is not None and time.monotonic() > section[2]:
                what, limit, _ = section
                self._stop.set()
                self._on_timeout(f"{what} took more than {limit:g} s")
                return
            if self._tick is not None:
                try:
                    self._tick()
                except Exception:  # a tick must never stop the watch
                    logger.exception("the watchdog's tick failed")
