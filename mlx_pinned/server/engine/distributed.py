"""Tensor-parallel serving: rank 0 leads the batch, the other ranks follow.

Every rank of an ``mx.distributed`` group (started by ``mlx.launch``, or by
a supervisor that sets ``MLX_RANK`` and ``MLX_HOSTFILE``) runs the same
command and loads its part of the model (:mod:`.shard`) on its MLX thread.

- Rank 0 serves HTTP. Its engine is the usual :class:`~.batch.BatchEngine`,
  whose batch is a :class:`LeaderState`: it records what the requests do to
  the batch (rows admitted, with their request and a seed drawn here; rows
  that left) and, before each step, sends that record to the other ranks
  (:mod:`.collectives`), then runs the step.
- A follower binds no port. Its MLX thread replays each message on a batch
  of its own and runs the same step, so every rank runs the same forward
  passes, whose sharded layers meet in ``all_sum``, and samples the same
  tokens: the logits after those sums are the same on every rank and each
  row's sampler is keyed by its seed and position. Text, log-probabilities
  and HTTP stay on rank 0.

When idle, rank 0 sends an empty message every :func:`heartbeat_interval`,
so a rank that is gone is found then too. Each message carries rank 0's step
counts: a follower whose own differ has diverged. Faults (a rank gone, a
step or a wait past ``distributed_timeout``, a divergence) are final: the
rank logs why and exits with status 1; rank 0 first closes its MLX thread
(``/health`` and every request answer 503) for :data:`FAULT_GRACE` seconds.
A supervisor restarts the group (docs/distributed.md). Rank 0's stop (after
its drain) is a message too: every follower exits 0.

Threads: the engine side runs on each rank's MLX thread; :class:`Leader`'s
:meth:`~Leader.stop` on the thread that ran the server, after it stopped;
the watchdog on its own thread; :class:`Follower`'s :meth:`~Follower.run`
on the main thread (it waits for the MLX thread).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from mlx_pinned import MLXPinnedError, MLXThread

from ..events import GenerationParams
from .batch import BatchEngine
from .collectives import Channel, Watchdog
from .model import LoadedModel, load
from .prefill import PREFILL_STEP
from .prompt_cache import PromptCache
from .rows import Row
from .shard import ShardError, plan, shard
from .state import BatchState

if TYPE_CHECKING:
    from PIL import Image

    from ..config import ServerConfig

__all__ = [
    "FAULT_GRACE",
    "FAULT_STATUS",
    "SETUP_STATUS",
    "DistributedError",
    "Follower",
    "GroupLostError",
    "Leader",
    "LeaderState",
    "heartbeat_interval",
    "join",
]

logger = logging.getLogger("mlx_pinned.server")

#: The exit status of a rank whose group was lost.
FAULT_STATUS = 1
#: The exit status when the group cannot start (no group, a model that
#: cannot be split): restarting would fail the same way.
SETUP_STATUS = 2
#: Seconds rank 0 answers 503 after its group is lost, before it exits.
FAULT_GRACE = 3.0
# A follower's load and rank 0's may differ this many timeouts, at most.
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
    """A row that left on rank 0."""

    row: int


@dataclass(frozen=True)
class Message:
    """What rank 0 did to its batch since its last message.

    Attributes:
        counts: Rank 0's step counts and tokens after ``ops`` (:func:`counts`).
        ops: Rows admitted and rows that left, in order.
        step: Whether a step follows them.
        stop: The group stops: each follower exits 0.
        settings: The first message only: the engine's settings, which
            every rank must share (rank 0's are the ones used).
    """

    counts: tuple[int, ...]
    ops: tuple[Admit | Leave, ...] = ()
    step: bool = False
    stop: bool = False
    settings: dict[str, int] | None = None


def counts(state: BatchState) -> tuple[int, ...]:
    """Steps, decoded tokens, prefills and each row's last token: the same on
    every rank in step (a rank that sampled otherwise differs)."""
    stats = state.statistics()
    tokens = (row.token for row in state.rows)
    return (stats.steps, stats.decoded_tokens, stats.prefills, *tokens)


def live_rows(state: BatchState | None) -> int:
    """Rows in the batch or joining it."""
    if state is None:
        return 0
    stats = state.statistics()
    return stats.active + stats.joining


def join(config: ServerConfig) -> Any:
    """This process's ``mx.distributed`` group, once its model is known to
    split over it. Main thread, before anything is loaded.

    Raises:
        DistributedError: No group (not started by ``mlx.launch`` or with
            its environment), a group of one, or a model that cannot be split.
    """
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as exc:
        raise DistributedError(
            f"--distributed tensor needs an mx.distributed group ({exc}): start "
            "every rank with mlx.launch, or set MLX_RANK and MLX_HOSTFILE"
        ) from None
    if group.size() < 2:
        raise DistributedError("--distributed tensor needs a group of 2 ranks or more")
    from mlx_vlm.utils import get_model_path, load_model

    # Lazily: only the shapes are read, to check the plan before the load.
    model = load_model(get_model_path(config.models[0]), lazy=True, strict=False)
    try:
        plan(model, group.size())
    except ShardError as exc:
        raise DistributedError(f"{exc}") from None
    return group


class _Rank:
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
        """The group is lost: log why, then exit with :data:`FAULT_STATUS`
        (after the grace). Any thread; the first call counts."""
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
        timer = threading.Timer(self._grace, _exit, (FAULT_STATUS,))
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


def _exit(status: int) -> None:
    """End the process now: the MLX thread may be stuck in a collective,
    which no Python code can interrupt."""
    time.sleep(0.2)  # the log's own thread writes what is queued
    sys.stderr.flush()
    os._exit(status)


class Leader(_Rank):
    """Rank 0's side of the group: loads its engine, leads the followers.

    Made on the main thread before the server starts; :meth:`load` is the
    app's engine factory (a start-up job on the MLX thread); :meth:`stop`
    runs once the server has stopped.
    """

    def __init__(self, group: Any, timeout: float) -> None:
        super().__init__(group, timeout, grace=FAULT_GRACE)
        self._thread: MLXThread | None = None
        self._state: LeaderState | None = None
        self._ops: list[Admit | Leave] = []
        self._ids: dict[Row, int] = {}
        self._next = 0
        self._lock = threading.Lock()  # one message at a time
        self._last = time.monotonic()
        self._beat: Future[None] | None = None
        self._stopping = False
        #: Rows each follower held at its last message, rank 1 first.
        self.follower_rows: tuple[int, ...] = ()
        self.watchdog.start()  # from here on, every wait is bounded

    def load(
        self,
        model_path: str | Path,
        thread: MLXThread,
        *,
        prompt_cache_bytes: int = 0,
        prefill_step_size: int = PREFILL_STEP,
        image_cache_bytes: int = 0,
    ) -> BatchEngine:
        """Load rank 0's part of the model and make its engine, once every
        follower has loaded its own; MLX thread (as ``BatchEngine.load``).

        Raises:
            DistributedError: A follower holds a different model.
            GroupLostError: A follower is gone.
        """
        loaded = load(
            model_path, shard=functools.partial(shard, group=self.channel.group)
        )
        self._thread = thread
        settings = {
            "prompt_cache_bytes": prompt_cache_bytes,
            "prefill_step_size": prefill_step_size,
            "image_cache_bytes": image_cache_bytes,
            "parameters": loaded.parameters,
        }
        hello = Message((0, 0, 0), settings=settings)
        with self.watchdog.watch("the other ranks' load", self.timeout * LOAD_WAIT):
            with self._lock:
                _, reports = self._exchange(hello, loaded.parameters)
        for rank, parameters in enumerate(reports[1:], start=1):
            if parameters != loaded.parameters:
                raise DistributedError(
                    f"rank {rank} holds {parameters} parameters of the model, rank "
                    f"0 {loaded.parameters}: start every rank with the same model"
                )
        self._last = time.monotonic()
        del settings["parameters"]
        return BatchEngine(loaded, thread, make_state=self._make_state, **settings)

    def _make_state(
        self, loaded: LoadedModel, cache: PromptCache, prefill_step: int
    ) -> BatchState:
        self._state = LeaderState(loaded, cache, prefill_step, leader=self)
        return self._state

    # -- what the batch tells it (MLX thread) ---------------------------------

    def admitted(
        self, row: Row, params: GenerationParams, images: Sequence[Image.Image]
    ) -> None:
        self._ids[row] = self._next
        self._ops.append(Admit(self._next, params, tuple(images)))
        self._next += 1

    def left(self, row: Row) -> None:
        ident = self._ids.pop(row, None)
        if ident is not None:
            self._ops.append(Leave(ident))

    def send(self, state: BatchState, *, step: bool) -> None:
        """Send what happened since the last message, and whether a step
        follows.

        Raises:
            GroupLostError: A follower is gone (the group exits).
        """
        with self._lock:
            ops, self._ops = tuple(self._ops), []
            message = Message(counts(state), ops, step=step)
            _, reports = self._exchange(message, live_rows(state))
            self._last = time.monotonic()
            self.follower_rows = tuple(reports[1:])

    # -- heartbeats (the watchdog's thread queues them on the MLX thread) -----

    def _tick(self) -> None:
        thread, beat = self._thread, self._beat
        if self._stopping or thread is None or thread.closed or self._state is None:
            return
        if time.monotonic() - self._last < self.heartbeat:
            return
        if beat is not None and not beat.done():
            return
        try:
            self._beat = thread.submit(self._beat_now)
        except MLXPinnedError:  # busy or closing: the next tick tries again
            pass

    def _beat_now(self) -> None:
        state = self._state
        if self._stopping or state is None:
            return
        if time.monotonic() - self._last < self.heartbeat:
            return  # a step sent a message meanwhile
        with self.watchdog.watch("a heartbeat", self.timeout):
            self.send(state, step=False)

    def _on_fault(self) -> None:
        # Every request and /health answer 503 from now on.
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        """Tell every follower to exit 0; once the server has stopped (its
        MLX thread is done). Nothing to do after a fault."""
        self._stopping = True
        if self.fault_reason is None:
            state = self._state
            message = Message((0, 0, 0) if state is None else counts(state), stop=True)
            try:
                with self.watchdog.watch("the stop", self.timeout), self._lock:
                    self._exchange(message, 0)
            except GroupLostError:
                pass  # logged; the process exits with the fault's status
            else:
                logger.info("rank 0: stopped the tensor-parallel group")
        if self.fault_reason is None:
            self.watchdog.stop()


class LeaderState(BatchState):
    """Rank 0's batch: what it does is sent to the followers, which do the
    same (MLX thread only)."""

    def __init__(
        self,
        loaded: LoadedModel,
        prompt_cache: PromptCache | None = None,
        prefill_step: int = PREFILL_STEP,
        *,
        leader: Leader,
    ) -> None:
        super().__init__(loaded, prompt_cache, prefill_step)
        self._leader = leader

    def admit(self, params: GenerationParams, images: Sequence[Image.Image]) -> Row:
        if params.seed is None:
            # Every rank samples the row alike: the seed is drawn here.
            params = dataclasses.replace(params, seed=random.getrandbits(32))
        row = super().admit(params, images)
        self._leader.admitted(row, params, images)
        return row

    def leave(self, row: Row) -> None:
        super().leave(row)
        self._leader.left(row)

    def ranks(self) -> tuple[int, ...]:
        return (live_rows(self), *self._leader.follower_rows)

    def step(self) -> None:
        leader = self._leader
        with leader.watchdog.watch("a batch step", leader.timeout):
            leader.send(self, step=True)
            super().step()


class Follower(_Rank):
    """A rank other than 0: loads its part, then replays rank 0's messages.

    Args:
        group: The ``mx.distributed`` group.
        config: The server's settings (rank 0's engine settings are used).
    """

    def __init__(self, group: Any, config: ServerConfig) -> None:
        super().__init__(group, config.distributed_timeout, grace=0.0)
        self._model = config.models[0]
        # Rank 0's whole stop: its drain window, then its in-flight requests.
        self._drain = config.drain_seconds + config.drain_timeout
        self._deadline: float | None = None  # after SIGTERM, for rank 0's stop

    def run(self) -> int:
        """Follow until rank 0 stops the group; the exit status. Main
        thread: SIGINT and SIGTERM wait for rank 0's stop (its drain needs
        every rank), for at most the drain timeout plus the timeout."""
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
        settings = dict(hello.settings)
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
        """Do what rank 0 did: its ops, a check that both batches are the
        same now, then its step."""
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
