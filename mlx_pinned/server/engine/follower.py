"""A rank other than 0: loads its part of the model, then replays rank 0's
batch message by message; it binds no port. :meth:`Follower.run` runs on
the main thread and waits for the MLX thread, where the load and the
replay run.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from mlx_pinned import MLXThread

from .batch import BatchEngine
from .group import (
    FAULT_STATUS,
    LOAD_WAIT,
    SETUP_STATUS,
    Admit,
    GroupLostError,
    Message,
    Rank,
    counts,
    live_rows,
)
from .model import LoadedModel, load
from .prompt_cache import PromptCache
from .rows import Row
from .shard import shard
from .state import BatchState

if TYPE_CHECKING:
    from ..config import ServerConfig

__all__ = ["Follower"]

logger = logging.getLogger("mlx_pinned.server")


class Follower(Rank):
    """A rank other than 0. ``config``: the server's settings (rank 0's engine
    settings are used)."""

    def __init__(self, group: Any, config: ServerConfig) -> None:
        super().__init__(group, config.distributed_timeout, grace=0.0)
        self._model = config.models[0]
        # Rank 0's whole stop: its unready window, then its in-flight requests.
        self._drain = config.unready_seconds + config.in_flight_timeout
        self._deadline: float | None = None  # after SIGTERM, for rank 0's stop

    def run(self) -> int:
        """Follow until rank 0 stops the group; the exit status. Main thread:
        SIGINT and SIGTERM wait for rank 0's stop (its drain needs every rank),
        for at most the drain timeout plus the timeout."""
        previous = {
            signum: signal.signal(signum, self._signalled)
            for signum in (signal.SIGINT, signal.SIGTERM)
        }
        thread = MLXThread(name="mlx-pinned")
        thread.start()
        self.watchdog.start()
        try:
            logger.info("rank %d: loading %s", self.rank, self._model)
            part = functools.partial(shard, group=self.channel.group)
            loaded = thread.run_sync(load, self._model, shard=part)
            return thread.run_sync(self._follow, loaded, thread)
        except GroupLostError:
            return FAULT_STATUS
        finally:
            self.watchdog.stop()
            thread.shutdown(wait=True, cancel_futures=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        if self._deadline is None:
            logger.info(
                "rank %d: %s: following until rank 0 stops the group",
                self.rank,
                signal.Signals(signum).name,
            )
            self._deadline = time.monotonic() + self._drain + self.timeout

    def _tick(self) -> None:
        deadline = self._deadline
        if deadline is not None and time.monotonic() > deadline:
            self._deadline = None
            self.fault("rank 0 did not stop the group in time after a signal")

    def _receive(self, what: str, seconds: float, report: int) -> Message:
        with self.watchdog.watch(what, seconds):
            message, _ = self._exchange(None, report)
        return message

    def _follow(self, loaded: LoadedModel, thread: MLXThread) -> int:
        """Replay rank 0's messages; MLX thread."""
        hello = self._receive(
            "rank 0's load", self.timeout * LOAD_WAIT, loaded.parameters
        )
        if hello.stop or hello.settings is None:
            logger.error("rank %d: rank 0 stopped before serving", self.rank)
            return FAULT_STATUS
        settings: dict[str, Any] = dict(hello.settings)
        if settings.pop("parameters") != loaded.parameters:
            logger.error("rank %d: rank 0 holds a different model", self.rank)
            return SETUP_STATUS
        states: list[BatchState] = []

        def make(loaded: LoadedModel, cache: PromptCache, step: int) -> BatchState:
            states.append(BatchState(loaded, cache, step))
            return states[0]

        BatchEngine(loaded, thread, make_state=make, **settings)
        state = states[0]
        rows: dict[int, Row] = {}
        logger.info("rank %d: following rank 0", self.rank)
        waiting = self.timeout + self.heartbeat
        while True:
            message = self._receive("rank 0's next message", waiting, live_rows(state))
            if message.stop:
                logger.info("rank %d: rank 0 stopped the group", self.rank)
                return 0
            with self.watchdog.watch("a batch step", self.timeout):
                self._replay(state, rows, message)

    def _replay(
        self, state: BatchState, rows: dict[int, Row], message: Message
    ) -> None:
        """Do what rank 0 did: its ops, a check that both batches are alike, then
        its step."""
        for op in message.ops:
            if isinstance(op, Admit):
                try:
                    rows[op.row] = state.admit(op.params, op.images)
                except Exception as exc:  # rank 0 admitted the same request
                    self.fault(f"a request rank 0 admitted failed here: {exc!r}")
                    raise GroupLostError("diverged from rank 0") from exc
            else:
                row = rows.pop(op.row, None)
                if row is not None:
                    state.leave(row)
        if message.counts != counts(state):
            self.fault(
                f"diverged from rank 0 (steps, tokens, prefills, last tokens: "
                f"{counts(state)} here, {message.counts} on rank 0)"
            )
            raise GroupLostError("diverged from rank 0")
        if message.step:
            try:
                state.step()
            except Exception:  # rank 0's step failed alike: its rows ended
                logger.debug("rank %d: a step failed", self.rank, exc_info=True)
        for row in rows.values():
            row.pending.clear()  # nobody reads the tokens here
