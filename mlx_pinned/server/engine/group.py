"""What every rank of a tensor-parallel group shares: rank 0's
:class:`Message`, sent or received by a :class:`Rank`, every wait watched,
and the fault that ends the process. Messages are made and read on the
MLX thread (rank 0's stop, on the thread that stopped the server); a fault
may be raised on any thread.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..events import GenerationParams
from .collectives import Channel, Watchdog
from .state import BatchState

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "FAULT_GRACE",
    "FAULT_STATUS",
    "LOAD_WAIT",
    "SETUP_STATUS",
    "Admit",
    "DistributedError",
    "GroupLostError",
    "Leave",
    "Message",
    "Rank",
    "counts",
    "exit_now",
    "heartbeat_interval",
    "live_rows",
]

logger = logging.getLogger("mlx_pinned.server")

#: The exit status of a rank whose group was lost.
FAULT_STATUS = 1
#: The exit status when the group cannot start (no group, a model that
#: cannot be split): restarting would fail the same way.
SETUP_STATUS = 2
#: Seconds rank 0 answers 503 after its group is lost, before it exits.
FAULT_GRACE = 3.0
#: A follower's load and rank 0's may differ this many timeouts, at most.
LOAD_WAIT = 10


class DistributedError(RuntimeError):
    """The group cannot serve this model; the message says why."""


class GroupLostError(RuntimeError):
    """A rank of the tensor-parallel group is gone or stuck."""


def heartbeat_interval(timeout: float) -> float:
    """Seconds between rank 0's messages while it is idle."""
    return max(0.1, min(1.0, timeout / 5))


@dataclass(frozen=True)
class Admit:
    """A row admitted on rank 0: its request, its seed set."""

    row: int
    params: GenerationParams
    images: tuple[Image.Image, ...]


@dataclass(frozen=True)
class Leave:
    row: int


@dataclass(frozen=True)
class Message:
    """What rank 0 did to its batch since its last message.

    Attributes:
        counts: Rank 0's step counts and tokens after ``ops`` (:func:`counts`).
        stop: The group stops: each follower exits 0.
        settings: The first message only: the engine's settings, which every
            rank must share.
    """

    counts: tuple[int, ...]
    ops: tuple[Admit | Leave, ...] = ()
    step: bool = False
    stop: bool = False
    settings: dict[str, int] | None = None


def counts(state: BatchState) -> tuple[int, ...]:
    """Steps, decoded tokens, prefills and each row's last token: the same on
    every rank in step."""
    stats = state.statistics()
    tokens = (row.token for row in state.rows)
    return (stats.steps, stats.decoded_tokens, stats.prefills, *tokens)


def live_rows(state: BatchState | None) -> int:
    if state is None:
        return 0
    stats = state.statistics()
    return stats.active + stats.joining


class Rank:
    """What both sides have: the channel, the watchdog, the fault."""

    def __init__(self, group: Any, timeout: float, *, grace: float) -> None:
        self.channel = Channel(group)
        self.rank = self.channel.rank
        self.timeout = timeout
        self.heartbeat = heartbeat_interval(timeout)
        self.watchdog = Watchdog(self.fault, tick=self._tick)
        self._grace = grace
        self._fault_lock = threading.Lock()
        self.fault_reason: str | None = None

    def fault(self, reason: str) -> None:
        """The group is lost: log why, then exit with :data:`FAULT_STATUS` after
        the grace. Any thread; the first call counts."""
        with self._fault_lock:
            if self.fault_reason is not None:
                return
            self.fault_reason = reason
        logger.error(
            "rank %d: the tensor-parallel group is lost (%s): exiting with status %d",
            self.rank,
            reason,
            FAULT_STATUS,
        )
        self._on_fault()
        timer = threading.Timer(self._grace, exit_now, (FAULT_STATUS,))
        timer.daemon = True
        timer.start()

    def _on_fault(self) -> None:
        pass

    def _tick(self) -> None:
        pass

    def _exchange(
        self, message: Message | None, report: int
    ) -> tuple[Message, list[int]]:
        payload = None if message is None else pickle.dumps(message, protocol=5)
        try:
            data, reports = self.channel.exchange(payload, report)
        except RuntimeError as exc:
            self.fault(f"{exc}")
            raise GroupLostError(f"the tensor-parallel group is lost: {exc}") from exc
        return (message if message is not None else pickle.loads(data)), reports


def exit_now(status: int) -> None:
    """End the process now: the MLX thread may be stuck in a collective,
    which no Python code can interrupt."""
    time.sleep(0.2)  # the log's own thread writes what is queued
    sys.stderr.flush()
    os._exit(status)
