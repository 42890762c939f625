"""The one model registry: every load and unload, the memory budget, and
the app's lifespan.

Event loop only; each load and unload runs on the MLX thread through the
callables ``app.py`` wires in. Models loaded at start-up are loaded by the
lifespan, in order. A model goes through:

===========  ===============================  ==============================
state        a request that arrives           leaves it for
===========  ===============================  ==============================
UNLOADED     starts a load and waits for it   LOADING
LOADING      waits for that same load         LOADED, or UNLOADED (it failed:
                                              its waiters get the error)
LOADED       holds the engine at once         UNLOADING, once idle: by its
                                              timeout, or to make room;
                                              DRAINING: an unload by API
DRAINING     waits, then loads it again       UNLOADING, once the requests
                                              using it have ended
UNLOADING    waits, then loads it again       UNLOADED
===========  ===============================  ==============================

A request holds its model from the moment it names it until its
generation is closed, waiting included; only a model no request holds is
*idle*, and only an idle one is unloaded by a timeout or the budget. Loads
and unloads take one lock, and no ``await`` comes between a check and the
state change that follows it. Loads and drains run in the lifespan's task
group, so a client that leaves does not cancel one that others wait for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from mlx_pinned import MLXPinnedError

from ..config_checks import SettingError
from ..failures import ModelLoadFailedError, ModelMemoryBudgetError, ModelNotLoadedError
from .served_models import ModelSlot, SlotChange, SlotState, due

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..resident import Resident
    from .served_models import ServedModel, ServedModels

__all__ = ["Residency", "StartUpRefusal"]

logger = logging.getLogger("mlx_pinned.server")

#: Frees the engine in the list it is given (emptying the list) on the MLX
#: thread; whoever calls it keeps no other reference.
Release = Callable[[list[Any], str], Awaitable[object]]


class Residency:
    """Loads every model, unloads idle ones, keeps the memory budget.

    Args:
        budget: Bytes of weights loaded at once, over all models (None: no
            limit).
        load_wait: Seconds a request waits for its model's load before a 503
            ``model_not_loaded`` (None: as long as the load takes).
        prepare: Runs before the start-up loads (the budget's check); what
            it raises fails the start-up.
        settle: Runs once the start-up loads are done.
    """

    def __init__(
        self,
        models: ServedModels,
        release: Release,
        *,
        budget: int | None = None,
        retry_after: int = 1,
        load_wait: float | None = None,
        prepare: Callable[[], Awaitable[object]] | None = None,
        settle: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.models = models
        self.release = release
        self.budget = budget
        self.retry_after = retry_after
        self.load_wait = load_wait
        self._prepare = prepare
        self._settle = settle
        self._slots = [model.slot for model in models]
        #: What failed the start-up, if it failed.
        self.failure: Exception | None = None
        self._tasks: TaskGroup | None = None
        self._lock: anyio.Lock | None = None
        self._wake: anyio.Event | None = None
        self._started = False

    @asynccontextmanager
    async def running(self, app: object = None) -> AsyncIterator[None]:
        """The lifespan (Starlette's ``lifespan=``); loads and the idle watch
        run inside it and are cancelled at its end. What ``prepare`` or a
        start-up load raised fails the start-up."""
        self._lock = anyio.Lock()
        self.failure = None
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            try:
                try:
                    await self._start_up()
                except Exception as exc:  # raised below: not as a group
                    self.failure = exc
                else:
                    self._started = True
                    tasks.start_soon(self._watch_idle)
                    yield
            finally:
                self._tasks = None
                self._started = False
                tasks.cancel_scope.cancel()
        if self.failure is not None:
            raise self.failure

    async def _start_up(self) -> None:
        if self._prepare is not None:
            await self._prepare()
        # All marked loading first: a request for the second waits for it
        # while the first loads.
        eager = [slot for slot in self._slots if slot.at_start_up]
        for slot in eager:
            slot.state = SlotState.LOADING
            slot._change = SlotChange()
        try:
            for slot in eager:
                change = slot._change
                assert change is not None
                await self._load(slot, change)
                if change.cause is not None:
                    raise change.cause
        finally:  # failed or cancelled: the rest will never load
            for slot in eager:
                if slot.state is SlotState.LOADING and slot._change is not None:
                    waiting, slot._change = slot._change, None
                    slot.state = SlotState.UNLOADED
                    waiting.error = ModelNotLoadedError(
                        slot.name, retry_after=self.retry_after
                    )
                    waiting.done.set()
        if self._settle is not None:
            await self._settle()

    @asynccontextmanager
    async def use(self, served: ServedModel) -> AsyncIterator[Resident]:
        """Hold ``served`` for the block and give its engine, loading it first
        if needed (waiting at most ``load_wait`` seconds). Close the
        generation inside the block: the model may be unloaded after it.

        Raises:
            ModelNotLoadedError: Its load did not end within ``load_wait``,
                or no lifespan runs to load it.
            ModelLoadFailedError: Its load failed (the next one may not).
            ModelMemoryBudgetError: It does not fit in the budget.
            MLXPinnedError: The MLX thread's own error in its load.
        """
        slot = served.slot
        slot.holders += 1
        slot.idle_since = None
        try:
            wait = math.inf if self.load_wait is None else self.load_wait
            engine: Resident | None = None
            with anyio.move_on_after(wait):
                engine = await self._loaded(slot)
            if engine is None:
                raise ModelNotLoadedError(slot.name, retry_after=self.retry_after)
            slot.serving += 1
            try:
                yield engine
            finally:
                slot.serving -= 1
                if slot.serving == 0 and slot._drained is not None:
                    slot._drained.set()
        finally:
            slot.holders -= 1
            if slot.idle:
                slot.idle_since = anyio.current_time()
                self._notify()

    def keep_alive(self, served: ServedModel, seconds: float | None) -> None:
        """Unload ``served`` once it has been idle for ``seconds`` (0: as
        soon as it is idle; ``math.inf``: never; None: after its
        ``idle_timeout``), until another request says otherwise. A pinned
        model stays."""
        served.slot.keep_alive = seconds
        self._notify()

    async def unload(self, served: ServedModel, why: str) -> bool:
        """Unload ``served`` once the requests using it have ended; requests
        that arrive meanwhile wait, then load it again. False if it was not
        loaded. Cancelling the caller leaves the unload to run to its end.

        Raises:
            ModelNotLoadedError: No lifespan runs to unload it.
        """
        slot = served.slot
        while slot.state is SlotState.LOADING:  # its load ends first
            assert slot._change is not None
            await slot._change.done.wait()
        if slot.state is not SlotState.LOADED:
            if slot._change is not None:  # already on its way out
                await slot._change.done.wait()
            return False
        if self._tasks is None:
            raise ModelNotLoadedError(slot.name, retry_after=self.retry_after)
        slot.state = SlotState.DRAINING
        slot.idle_since = None
        change = slot._change = SlotChange()
        slot._drained = anyio.Event()
        if slot.serving == 0:
            slot._drained.set()
        self._tasks.start_soon(self._drain, slot, change, why)
        await change.done.wait()
        return True

    async def _drain(self, slot: ModelSlot, change: SlotChange, why: str) -> None:
        assert self._lock is not None
        assert slot._drained is not None
        await slot._drained.wait()
        slot._drained = None
        async with self._lock:
            await self._unload(slot, why, change)

    def weight_bytes(self) -> int:
        return sum(slot.weight_bytes or 0 for slot in self._slots if _held(slot))

    def _kept_bytes(self) -> int:
        """Bytes the budget cannot free: models loaded at start-up or pinned."""
        return sum(
            slot.weight_bytes or 0
            for slot in self._slots
            if _held(slot) and (slot.at_start_up or slot.pinned)
        )

    async def _loaded(self, slot: ModelSlot) -> Resident:
        """The slot's engine once loaded; the caller holds the slot, so it
        cannot be unloaded again before the caller lets go."""
        while True:
            if slot.state is SlotState.LOADED:
                assert slot.engine is not None
                return slot.engine
            if slot.state is SlotState.UNLOADED:
                if slot.at_start_up and not self._started:  # not begun yet
                    raise ModelNotLoadedError(slot.name, retry_after=self.retry_after)
                self._start_load(slot)
            change = slot._change
            assert change is not None, "a slot loading or unloading has a change"
            await change.done.wait()
            if change.error is not None:
                raise change.error

    def _start_load(self, slot: ModelSlot) -> None:
        if self._tasks is None:  # no lifespan runs: nothing can load it
            raise ModelNotLoadedError(slot.name, retry_after=self.retry_after)
        slot.state = SlotState.LOADING
        slot._change = SlotChange()
        self._tasks.start_soon(self._load, slot, slot._change)

    async def _load(self, slot: ModelSlot, change: SlotChange) -> None:
        assert self._lock is not None
        engine: Resident | None = None
        try:
            async with self._lock:
                need = slot.weight_bytes
                if need is None and self.budget is not None:
                    need = await slot.measure()
                await self._make_room(slot, need or 0)
                engine = await slot.load()
        except ModelMemoryBudgetError as error:  # already logged
            change.error = error
        except Exception as exc:
            slot.failures += 1
            # A setting the model cannot take (--kv-bits on a sliding
            # window) is the user's to fix: its message, no traceback.
            trace = None if isinstance(exc, SettingError) else exc
            logger.error("loading model %r failed: %s", slot.name, exc, exc_info=trace)
            # The MLX thread's own errors (busy, gone) are answered as such.
            failed = ModelLoadFailedError(slot.name, retry_after=self.retry_after)
            change.error = exc if isinstance(exc, MLXPinnedError) else failed
            change.cause = exc
        except BaseException:  # cancelled: the server is shutting down
            change.error = ModelNotLoadedError(slot.name, retry_after=self.retry_after)
            raise
        finally:
            if engine is None:
                slot.state = SlotState.UNLOADED
            else:
                slot.engine = engine
                slot.facts = engine.facts
                slot.weight_bytes = engine.weight_bytes
                slot.state = SlotState.LOADED
                slot.loads += 1
                if slot.holders == 0:  # its waiters left meanwhile
                    slot.idle_since = anyio.current_time()
            del engine
            slot._change = None
            change.done.set()
            self._notify()

    async def _make_room(self, slot: ModelSlot, need: int) -> None:
        """Unload idle models, least recently used first, until ``need``
        more bytes fit in the budget; refuse (503) when even unloading every
        idle one would not make them fit, unloading none. Lock held."""
        budget = self.budget
        if budget is None or self.weight_bytes() + need <= budget:
            return
        kept = self._kept_bytes()
        idle = sorted(
            (other for other in self._slots if other.evictable),
            key=lambda other: other.idle_since or -math.inf,
        )
        freeable = sum(other.weight_bytes or 0 for other in idle)
        refused = ModelMemoryBudgetError(
            slot.name, need, budget, kept, retry_after=self.retry_after
        )
        if self.weight_bytes() - freeable + need > budget:
            logger.warning("%s", refused.message)
            raise refused
        for other in idle:
            if self.weight_bytes() + need <= budget:
                return
            if other.evictable:  # not taken by a request during the last unload
                await self._unload(other, f"to make room for {slot.name!r}")
        if self.weight_bytes() + need > budget:
            raise refused

    async def _unload(
        self, slot: ModelSlot, why: str, change: SlotChange | None = None
    ) -> None:
        """Unload a slot no request uses on the MLX thread, ending
        ``change`` (a drain's) or a change of its own. Lock held; the caller
        saw no request use it with no ``await`` since."""
        assert slot.serving == 0, "only a model no request uses is unloaded"
        assert slot.engine is not None
        slot.state = SlotState.UNLOADING
        slot.idle_since = None
        change = slot._change = change or SlotChange()
        holder: list[Any] = [slot.engine]
        slot.engine = None
        logger.info("unloading model %r (%s)", slot.name, why)
        try:
            await self.release(holder, slot.name)
        except Exception:  # the MLX thread is gone: the engine goes anyway
            logger.exception("releasing model %r failed", slot.name)
        finally:
            holder.clear()
            slot.state = SlotState.UNLOADED
            slot.unloads += 1
            slot._change = None
            change.done.set()

    async def _watch_idle(self) -> None:
        """Unload each model idle for its ``idle_timeout``; sleeps until the
        next one is due, or until a model's state changes."""
        assert self._lock is not None
        while True:
            self._wake = anyio.Event()
            now = anyio.current_time()
            dues = {slot: at for slot in self._slots if (at := due(slot)) is not None}
            expired = [slot for slot, at in dues.items() if at <= now]
            if not expired:
                with anyio.move_on_after(min(dues.values(), default=math.inf) - now):
                    await self._wake.wait()
                continue
            async with self._lock:
                for slot in expired:
                    # Checked again: a request may have taken it while this
                    # waited for the lock.
                    at = due(slot)
                    if at is not None and at <= now:
                        idle = f"idle for {slot.unload_after:g} s"
                        await self._unload(slot, idle)

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()


def _held(slot: ModelSlot) -> bool:
    return slot.state in (SlotState.LOADED, SlotState.DRAINING)


class StartUpRefusal:
    """Pure ASGI, around the app whose lifespan ``residency`` is: a start-up
    a setting refused (a :class:`~..config_checks.SettingError`, e.g.
    ``--kv-bits`` on a model that cannot take it) fails without Starlette's
    traceback, as the log's one line names the setting. Event loop only."""

    def __init__(self, app: ASGIApp, *, residency: Residency) -> None:
        self.app = app
        self.residency = residency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def told(message: Message) -> None:
            refused = isinstance(self.residency.failure, SettingError)
            if refused and message["type"] == "lifespan.startup.failed":
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, told if scope["type"] == "lifespan" else send)
