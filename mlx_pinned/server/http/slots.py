"""A served model's slot: its state, its engine while loaded, its counts.

Event loop only: :class:`~.residency.Residency` (the one model registry)
moves each slot through its states; requests read its engine.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from ..events import Resident
    from .capabilities import Capabilities

__all__ = ["ModelSlot", "SlotChange", "SlotState", "due"]


class SlotState(enum.Enum):
    """Where a model loaded on first use is (see the module's table)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
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
        name: The served name.
        load: Loads it on the MLX thread and gives its engine.
        measure: Its weight bytes from its checkpoint, on the MLX thread
            (the budget's measure before the first load).
        pinned: Loaded by the lifespan at start-up and never unloaded; else
            loaded on first use.
        idle_timeout: Seconds idle before it is unloaded (None: never).
        state: See :class:`SlotState`.
        engine: Its engine (of its kind) while LOADED.
        capabilities: What its engine can take, read on first use after
            each load (:meth:`~.capabilities.Capabilities.of`); None once
            it is unloaded.
        holders: Requests holding it now (:meth:`Residency.use`).
        weight_bytes: Its weights' bytes, measured at its last load; None
            before the first.
        idle_since: When the last holder let go (``anyio.current_time()``),
            while LOADED and idle; None otherwise.
        created: Unix time the server was made: the ``created`` in
            ``/v1/models`` of a model loaded on first use, which does not
            move with loads.
        loads, unloads, failures: Loads done, unloads done, loads failed.
    """

    name: str
    load: Callable[[], Awaitable[Resident]]
    measure: Callable[[], Awaitable[int]]
    pinned: bool = False
    idle_timeout: float | None = None
    state: SlotState = SlotState.UNLOADED
    engine: Resident | None = None
    capabilities: Capabilities | None = None
    holders: int = 0
    weight_bytes: int | None = None
    idle_since: float | None = None
    created: float = field(default_factory=time.time)
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    _change: SlotChange | None = field(default=None, repr=False)

    @property
    def idle(self) -> bool:
        """Loaded on first use, loaded now, and held by no request."""
        return self.state is SlotState.LOADED and self.holders == 0 and not self.pinned


def due(slot: ModelSlot) -> float | None:
    """When an idle slot is unloaded (``anyio.current_time()``); None while
    it is not idle, or never is unloaded for it."""
    if not slot.idle or slot.idle_since is None or slot.idle_timeout is None:
        return None
    return slot.idle_since + slot.idle_timeout
