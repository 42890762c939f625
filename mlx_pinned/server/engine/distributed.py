"""Tensor-parallel serving (docs/distributed.md): rank 0 serves HTTP and
leads the batch (:class:`Leader`, :class:`LeaderState`), sending what its
requests did to it before each step; the other ranks replay it
(:class:`~.follower.Follower`). The batch runs on each rank's MLX thread;
:meth:`Leader.stop` on the thread that ran the server, after it stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from mlx_pinned import MLXPinnedError, MLXThread

from ..events import GenerationParams
from .batch import BatchEngine, output_formats
from .follower import Follower
from .group import (
    FAULT_GRACE,
    FAULT_STATUS,
    LOAD_WAIT,
    SETUP_STATUS,
    Admit,
    DistributedError,
    GroupLostError,
    Leave,
    Message,
    Rank,
    counts,
    live_rows,
)
from .model import LoadedModel, load
from .prefill import PREFILL_STEP
from .prompt_cache import PromptCache
from .rows import Row
from .shard import ShardError, plan, shard
from .state import BatchState

if TYPE_CHECKING:
    from PIL import Image

    from ..config import ModelSettings, ServerConfig

__all__ = [
    "FAULT_STATUS",
    "SETUP_STATUS",
    "DistributedError",
    "Follower",
    "GroupLostError",
    "Leader",
    "LeaderState",
    "join",
]

logger = logging.getLogger("mlx_pinned.server")


def join(config: ServerConfig) -> Any:
    """This process's ``mx.distributed`` group, once its model is known to split
    over it. Main thread, before anything is loaded.

    Raises:
        DistributedError: No group, a group of one, or a model that cannot be
            split.
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


class Leader(Rank):
    """Rank 0's side of the group: loads its engine, leads the followers.
    Made on the main thread before the server starts; :meth:`load` is the
    app's engine factory (a start-up job on the MLX thread)."""

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

    def load(self, settings: ModelSettings, thread: MLXThread) -> BatchEngine:
        """Load rank 0's part of the model and make its engine, once every
        follower has loaded its own; MLX thread. Its caches and prefill
        step go to the followers; every rank must cut a prompt alike, so a
        chunk is ``prefill_step_size`` tokens (not paced by time).

        Raises:
            DistributedError: A follower holds a different model.
            GroupLostError: A follower is gone.
        """
        loaded = load(
            settings.path, shard=functools.partial(shard, group=self.channel.group)
        )
        self._thread = thread
        shared = {
            "prompt_cache_bytes": settings.prompt_cache_bytes,
            "prefill_step_size": settings.prefill_step_size,
            "image_cache_bytes": settings.image_cache_bytes,
        }
        hello = Message((0, 0, 0), settings={**shared, "parameters": loaded.parameters})
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
        formats = output_formats(loaded, settings)
        return BatchEngine(
            loaded, thread, make_state=self._make_state, formats=formats, **shared
        )

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
        """Send what happened since the last message, and whether a step follows.

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
        """Tell every follower to exit 0, once the server has stopped; nothing
        after a fault."""
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
    """Rank 0's batch: what it does is sent to the followers, which do the same."""

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
        if params.sampling.seed is None:
            # Every rank samples the row alike: the seed is drawn here.
            seed = random.getrandbits(32)
            sampling = dataclasses.replace(params.sampling, seed=seed)
            params = dataclasses.replace(params, sampling=sampling)
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
