"""The served models as the HTTP side sees them: a name, a kind, a gate
(:class:`~.gate.BatchGate`) and a slot (its state, its engine while loaded, its
counts; :mod:`.residency` loads and unloads it).

Event loop only.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from ..kinds import kind_named
from .errors import APIError
from .gate import BatchGate

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
