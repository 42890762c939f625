"""The served models as the HTTP side sees them: a name, a kind, a gate
(:class:`BatchGate`) and a slot (its state, its engine while loaded, its
counts; :mod:`.residency` loads and unloads it).

Event loop only.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from anyio.lowlevel import (
    RunVar,
    cancel_shielded_checkpoint,
    checkpoint_if_cancelled,
)

from ..failures import OverloadedError
from ..kinds import kind_named
from .errors import APIError

if TYPE_CHECKING:
    from ..resident import Facts, Resident

__all__ = [
    "BatchGate",
    "ModelSlot",
    "ServedModel",
    "ServedModels",
    "SlotChange",
    "SlotState",
    "due",
    "expires_at",
    "model_not_found",
]


class SlotState(enum.Enum):
    """Where a model loaded on first use is (:mod:`.residency` has the table)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"
    UNLOADING = "unloading"


class SlotChange:
    """One load or unload under way: its waiters wait for ``done``; a load
    that failed leaves its answer in ``error`` and what it raised in
    ``cause``."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: Exception | None = None
        self.cause: BaseException | None = None


@dataclass(eq=False)
class ModelSlot:
    """A served model: its state, engine and counts.

    Attributes:
        load, measure: Run on the MLX thread; ``measure`` gives the weight
            bytes from the checkpoint, the budget's before the first load.
        at_start_up: Loaded by the lifespan at start-up; never unloaded but
            by a request (``keep_alive``, an unload by API).
        pinned: Never unloaded by the idle timeout, ``keep_alive`` or the
            memory budget; only by an unload by API.
        idle_timeout: Seconds idle before it is unloaded (None: never).
        keep_alive: The last Ollama request's ``keep_alive`` in seconds,
            which replaces ``idle_timeout`` (``math.inf``: never; None: none
            was asked).
        holders: Requests that named it, waiting for it or using it.
        serving: Those that have its engine (an unload drains them).
        idle_since: When the last holder let go (``anyio.current_time()``),
            while LOADED and idle; None otherwise.
        created: Unix time the server was made: the ``created`` in
            ``/v1/models``, which does not move with loads.
        facts: Its engine's facts at its last load (None: never loaded).
    """

    name: str
    load: Callable[[], Awaitable[Resident]]
    measure: Callable[[], Awaitable[int]]
    at_start_up: bool = False
    pinned: bool = False
    idle_timeout: float | None = None
    keep_alive: float | None = None
    state: SlotState = SlotState.UNLOADED
    engine: Resident | None = None
    holders: int = 0
    serving: int = 0
    weight_bytes: int | None = None
    idle_since: float | None = None
    created: float = field(default_factory=time.time)
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    facts: Facts | None = None
    _change: SlotChange | None = field(default=None, repr=False)
    _drained: anyio.Event | None = field(default=None, repr=False)

    @property
    def idle(self) -> bool:
        """Loaded now, and held by no request."""
        return self.state is SlotState.LOADED and self.holders == 0

    @property
    def evictable(self) -> bool:
        """Idle, and one the memory budget may unload: loaded on first use
        and not pinned."""
        return self.idle and not self.at_start_up and not self.pinned

    @property
    def unload_after(self) -> float | None:
        """Seconds idle before it is unloaded (None: never)."""
        if self.pinned:
            return None
        timeout = self.keep_alive
        if timeout is None:
            timeout = None if self.at_start_up else self.idle_timeout
        return None if timeout is None or math.isinf(timeout) else timeout


def due(slot: ModelSlot) -> float | None:
    """When an idle slot is unloaded (``anyio.current_time()``); None while
    it is not idle, or never is unloaded for it."""
    after = slot.unload_after
    if not slot.idle or slot.idle_since is None or after is None:
        return None
    return slot.idle_since + after


def expires_at(slot: ModelSlot) -> float | None:
    """When a loaded slot will be unloaded, as Unix time (at the soonest,
    while a request uses it); None while it is not loaded, or never will
    be."""
    after = slot.unload_after
    if slot.state is not SlotState.LOADED or after is None:
        return None
    at = due(slot)
    left = after if at is None else at - anyio.current_time()
    return time.time() + max(left, 0.0)


@dataclass(frozen=True)
class ServedModel:
    """One model of the server, with a gate and a batch of its own; ``kind``
    says which routes serve it."""

    name: str
    gate: BatchGate
    slot: ModelSlot
    kind: str = "chat"

    def engine(self) -> Resident | None:
        """None while it is not loaded."""
        return self.slot.engine

    def check_kind(self, kind: str, route: str) -> None:
        """Refuse it on a route of another kind with a 400 that names the
        route it belongs on."""
        if kind != self.kind:
            mine = kind_named(self.kind)
            what, where = mine.what, mine.paths[0]
            raise APIError(
                400,
                f"The model {self.name!r} is {what}: send it to {where}, not {route}.",
                param="model",
                code="wrong_model_kind",
            )


def model_not_found(name: str, served: Sequence[str]) -> APIError:
    listed = ", ".join(repr(item) for item in served)
    return APIError(
        404,
        f"The model {name!r} does not exist: this server serves {listed}.",
        param="model",
        code="model_not_found",
    )


class ServedModels:
    """The server's models by name, in the order they were given."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("serve at least one model")
        self._by_name = {model.name: model for model in models}
        if len(self._by_name) != len(models):
            raise ValueError("each served model needs its own name")

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> ServedModel:
        """The model served as ``name``, or as ``name`` with Ollama's
        default tag ``:latest``; a 404 naming the served ones if none is."""
        found = self._by_name.get(name) or self._by_name.get(
            name.removesuffix(":latest")
        )
        if found is None:
            raise model_not_found(name, self.names)
        return found


@dataclass(order=True)
class _Waiter:
    """A request waiting for a slot; waiters order by priority, then arrival."""

    priority: int
    arrival: int
    ready: anyio.Event = field(compare=False, default_factory=anyio.Event)
    handed: bool = field(compare=False, default=False)  # a slot is its own


class _Slots:
    """One event loop's free slots and its waiting room (a heap)."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.room: list[_Waiter] = []
        self._arrivals = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self.free > 0:  # nobody waits while a slot is free
            await checkpoint_if_cancelled()
            self.free -= 1
            await cancel_shielded_checkpoint()
            return
        waiter = _Waiter(priority, next(self._arrivals))
        heapq.heappush(self.room, waiter)
        try:
            await waiter.ready.wait()
        except BaseException:
            if waiter.handed:  # given a slot as it was cancelled: pass it on
                self.release()
            else:
                self.room.remove(waiter)
                heapq.heapify(self.room)
            raise

    def release(self) -> None:
        if self.room:
            waiter = heapq.heappop(self.room)
            waiter.handed = True
            waiter.ready.set()
        else:
            self.free += 1


class BatchGate:
    """At most ``max_num_seqs`` generations at once; the rest wait their turn.

    Event loop (asyncio or trio, through anyio). Waiting requests are
    admitted as slots free up, the lowest ``priority`` first (vLLM's) and
    in arrival order within one; past ``max_pending`` waiting, :meth:`turn`
    refuses at once, telling the client to retry after ``retry_after``
    seconds. A slot is given back when the ``turn()`` block exits, so close
    the stream inside it.
    """

    def __init__(
        self, max_num_seqs: int, max_pending: int, *, retry_after: int = 1
    ) -> None:
        if max_num_seqs < 1 or max_pending < 0:
            raise ValueError(
                "max_num_seqs must be >= 1 and max_pending >= 0, not "
                f"{max_num_seqs} and {max_pending}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_pending = max_pending
        self.retry_after = retry_after
        self.waiting = 0  # requests waiting for a slot
        self.active = 0  # requests holding a slot
        # One set of slots per event loop: a gate used again under another loop
        # (or backend) must not wait on the first one's.
        self._slots: RunVar[_Slots] = RunVar("mlx_pinned_batch_gate")

    @property
    def busy(self) -> bool:
        return self.active > 0

    @asynccontextmanager
    async def turn(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold a slot for the block (``priority``: lower is sooner).
        Cancelling the caller while it waits gives up its place.

        Raises:
            OverloadedError: ``max_pending`` requests wait already.
        """
        try:
            slots = self._slots.get()
        except LookupError:  # the first turn on this event loop
            slots = _Slots(self.max_num_seqs)
            self._slots.set(slots)
        # Who waits, as the room counts it: a slot being handed to a waiter
        # leaves the room at once, before that waiter runs again (the gate's
        # own count lags until then).
        queued = len(slots.room)
        if slots.free == 0 and queued >= self.max_pending:
            raise OverloadedError(queued, retry_after=self.retry_after)
        self.waiting += 1
        try:
            await slots.acquire(priority)
        finally:
            self.waiting -= 1
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            slots.release()
