"""Who runs, who waits and who is refused: a model's gate (:class:`BatchGate`)
gives each request a :class:`Place` (a turn, or a place in its waiting
room), and the server's :class:`MemoryBudget` prices what each one holds.

Event loop only (asyncio or trio, through anyio).
"""

from __future__ import annotations

import heapq
import itertools
import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from anyio.lowlevel import RunVar

from ..config import machine_memory
from ..events import Engine
from ..failures import MemoryBusyError, MemoryTooLargeError, OverloadedError
from .outbox import spawn

if TYPE_CHECKING:
    from PIL import Image

    from ..config import ModelSettings, ServerConfig
    from ..events import GenerationParams
    from ..resident import Resident
    from .served_models import ServedModels

__all__ = ["BatchGate", "Charge", "MemoryBudget", "Place", "kv_tokens", "price"]

#: mlx-lm's KV caches grow by this many tokens at a time.
KV_STEP = 256
#: What a chat template adds beyond its messages' JSON (a default system
#: prompt, a tools preamble), in tokens.
TEMPLATE_TOKENS = 256


@dataclass
class Charge:
    """What one request is charged: ``images`` bytes (its decoded media and
    their float32 pixel values) from its entry, and the KV of ``tokens``
    tokens (its prompt, an upper bound until :meth:`Place.settle`, plus
    ``max_tokens``) at ``per_token`` bytes from its turn; ``least``: the
    fewest tokens its KV can take."""

    images: int = 0
    tokens: int = 0
    per_token: int = 0
    least: int = 0

    def alone(self, tokens: int) -> int:
        """Its bytes with ``tokens`` tokens of KV, with no neighbour."""
        return self.images + kv_bytes(1, tokens, self.per_token)


def kv_bytes(rows: int, tokens: int, per_token: int) -> int:
    """The KV of ``rows`` rows padded to ``tokens`` tokens, as caches grow."""
    return rows * -(-tokens // KV_STEP) * KV_STEP * per_token


def kv_tokens(params: GenerationParams, prompt: int) -> int:
    """The tokens of KV a generation of ``params`` holds at most after a
    ``prompt`` of that many tokens: ``max_tokens`` more, within the context."""
    context = params.context_length
    total = prompt + params.max_tokens
    return total if context is None else min(total, context)


def price(
    params: GenerationParams,
    images: Sequence[Image.Image],
    per_token: int,
    least_prompt: int = 0,
) -> Charge:
    """What a generation of ``params`` with ``images`` is charged at its entry:
    its prompt's tokens bounded from above by its text's UTF-8 bytes (a token
    is at least a byte) and :data:`TEMPLATE_TOKENS`, or by its prompt limit
    where it has media (their tokens are counted once processed), and from
    below by ``least_prompt``."""
    pixels = sum(i.width * i.height * len(i.getbands()) for i in images)
    pixels += sum(int(video.frames.nbytes) for video in params.videos)
    media = 5 * pixels + 2 * sum(int(a.samples.nbytes) for a in params.audios)
    if isinstance(params.prompt, tuple):
        prompt = len(params.prompt) + TEMPLATE_TOKENS
    else:
        text = params.prompt or json.dumps(
            [params.messages, params.tools], ensure_ascii=False, default=str
        )
        prompt = len(text.encode()) + TEMPLATE_TOKENS
    limit = params.max_prompt_tokens or params.context_length
    if limit is not None and (images or params.videos or params.audios):
        prompt = limit
    prompt = prompt if limit is None else min(prompt, limit)
    least = kv_tokens(params, least_prompt)
    return Charge(media, max(kv_tokens(params, prompt), least), per_token, least)


@dataclass(order=True)
class Place:
    """A request's place at its model's gate, from its entry to its exit:
    in the waiting room, then with a turn; the lowest ``priority`` is
    served first, in arrival order within one."""

    priority: int
    arrival: int
    charge: Charge = field(compare=False)
    ready: anyio.Event = field(compare=False, default_factory=anyio.Event)
    room: _Room | None = field(compare=False, default=None, repr=False)

    @property
    def has_turn(self) -> bool:
        return self.ready.is_set()

    async def turn(self) -> None:
        """Wait for its turn; cancelled, the place is given up at its exit."""
        await self.ready.wait()

    def settle(self, tokens: int) -> None:
        """Its KV's tokens, now exact (the engine counted its prompt).

        Raises:
            MemoryTooLargeError: It alone needs more than the budget.
        """
        if self.room is not None:
            self.room.settle(self, tokens)


class MemoryBudget:
    """The bytes the requests of every model are charged, within ``limit()``
    (None: no limit) and what the prompt caches lend it: past the limit a
    request waits for its turn, and ``lend(n)`` makes the caches keep
    ``n`` bytes under their budgets (``lendable()`` in all) before it waits.

    A model's rows pad to its longest (its batch is one KV cache), so its
    turns are charged as many times its longest KV.
    """

    def __init__(
        self,
        limit: Callable[[], int | None],
        *,
        retry_after: int = 1,
        lendable: Callable[[], int] = lambda: 0,
        lend: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.lendable = lendable
        self._lend = lend
        self.lent = 0  # bytes the prompt caches keep free for the charges
        self.served: ServedModels | None = None  # the models it counts (:meth:`of`)
        self._lending = False
        self._rooms: weakref.WeakSet[_Room] = weakref.WeakSet()

    @classmethod
    def of(cls, config: ServerConfig, each: Sequence[ModelSettings]) -> MemoryBudget:
        """The budget over every model of ``served`` (set once they exist):
        ``--max-kv-bytes`` (by default three quarters of memory, less the
        weights loaded and the caches' budgets), and what their prompt
        caches lend it."""
        caches = sum(own.prompt_cache_bytes + own.image_cache_bytes for own in each)
        share = machine_memory() * 3 // 4

        def engines() -> list[Resident | None]:
            return [model.engine() for model in budget.served or ()]

        def loaded() -> list[tuple[ModelSettings, Engine]]:
            pairs = zip(each, engines(), strict=True)
            return [(own, e) for own, e in pairs if isinstance(e, Engine)]

        def limit() -> int | None:
            if config.max_kv_bytes is not None:
                return config.max_kv_bytes or None
            weights = sum(engine.weight_bytes for engine in engines() if engine)
            return max(0, share - weights - caches)

        async def lend(nbytes: int) -> None:
            for own, engine in loaded():  # the first caches first; the rest keep all
                part = min(nbytes, own.prompt_cache_bytes)
                await engine.lend_cache(part)
                nbytes -= part

        if config.distributed:  # a loan on rank 0 alone would part the ranks' caches
            budget = cls(limit, retry_after=config.retry_after)
        else:
            budget = cls(
                limit,
                retry_after=config.retry_after,
                lendable=lambda: sum(own.prompt_cache_bytes for own, _ in loaded()),
                lend=lend,
            )
        return budget

    @property
    def charged(self) -> int:
        return sum(room.charged() for room in self._rooms)

    @property
    def running(self) -> bool:
        """Whether any request of any model has its turn."""
        return any(room.turns for room in self._rooms)

    def capacity(self) -> float:
        limit = self.limit()
        return float("inf") if limit is None else limit + self.lent

    def check_entry(self, charge: Charge) -> None:
        """Refuse a request that never fits, even with its fewest tokens, and
        images that do not fit now (unless nothing else is charged)."""
        limit = self.limit()
        if limit is None:
            return
        most = limit + self.lendable()
        if charge.alone(charge.least) > most:
            raise MemoryTooLargeError(charge.alone(charge.least), limit)
        if self.charged and self.charged + charge.images > most:
            raise MemoryBusyError(limit, retry_after=self.retry_after)

    def fits(self, extra: int) -> bool:
        """Whether ``extra`` more bytes fit now; asks the caches to lend
        where only their lending would make them fit."""
        after = self.charged + extra
        if after <= self.capacity() or not self.running:
            return True
        limit = self.limit()
        assert limit is not None, "an unlimited budget always fits"
        if after <= limit + self.lendable():
            self._rebalance(after - limit)
        return False

    def changed(self) -> None:
        """Charges fell or settled: give the caches back what they lent,
        and hand out the turns that now fit."""
        for room in list(self._rooms):
            room.hand_out()
        limit = self.limit()
        if limit is not None:
            self._rebalance(max(0, self.charged - limit))

    def _rebalance(self, want: int) -> None:
        want = min(want, self.lendable())
        if self._lend is None or self._lending or want == self.lent:
            return
        self._lending = True
        spawn(self._lend_now, want)

    async def _lend_now(self, want: int) -> None:
        try:
            if self._lend is not None:
                await self._lend(want)
            self.lent = want
        except Exception:  # the MLX thread is gone: asking again would spin
            self._lend = None
        finally:
            self._lending = False
            self.changed()


class _Room:
    """One gate's turns and waiting room on one event loop."""

    def __init__(self, gate: BatchGate) -> None:
        self.gate = gate
        self.free = gate.max_num_seqs
        self.waiting: list[Place] = []  # a heap
        self.turns: list[Place] = []
        self.arrivals = itertools.count()
        if gate.budget is not None:
            gate.budget._rooms.add(self)

    def charged(self) -> int:
        images = sum(p.charge.images for p in (*self.waiting, *self.turns))
        return images + self.kv(self.turns)

    @staticmethod
    def kv(turns: list[Place]) -> int:
        if not turns:
            return 0
        longest = max(place.charge.tokens for place in turns)
        return kv_bytes(len(turns), longest, max(p.charge.per_token for p in turns))

    def enter(self, place: Place) -> None:
        heapq.heappush(self.waiting, place)
        self.gate.waiting += 1
        self.hand_out()

    def hand_out(self) -> None:
        budget = self.gate.budget
        while self.free and self.waiting:
            head = self.waiting[0]
            if budget is not None:
                extra = self.kv([*self.turns, head]) - self.kv(self.turns)
                if not budget.fits(extra):
                    return
            heapq.heappop(self.waiting)
            self.gate.waiting -= 1
            self.free -= 1
            self.gate.active += 1
            self.turns.append(head)
            head.ready.set()

    def settle(self, place: Place, tokens: int) -> None:
        place.charge.tokens = tokens
        budget = self.gate.budget
        if budget is None:
            return
        limit = budget.limit()
        need = place.charge.alone(tokens)
        if limit is not None and need > limit + budget.lendable():
            raise MemoryTooLargeError(need, limit)
        budget.changed()

    def leave(self, place: Place) -> None:
        if place in self.turns:
            self.turns.remove(place)
            self.free += 1
            self.gate.active -= 1
        else:
            self.waiting.remove(place)
            heapq.heapify(self.waiting)
            self.gate.waiting -= 1
        if self.gate.budget is not None:
            self.gate.budget.changed()
        else:
            self.hand_out()


class BatchGate:
    """At most ``max_num_seqs`` generations at once; the rest wait their turn.

    Waiting requests get their turns as turns free up (and, under a
    ``budget``, as their bytes fit), the lowest ``priority`` first (vLLM's)
    and in arrival order within one; past ``max_pending`` waiting,
    :meth:`enter` refuses at once, telling the client to retry after
    ``retry_after`` seconds. A place is given up when its block exits, so
    close the stream inside it.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_pending: int,
        *,
        retry_after: int = 1,
        budget: MemoryBudget | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_pending < 0:
            raise ValueError(
                "max_num_seqs must be >= 1 and max_pending >= 0, not "
                f"{max_num_seqs} and {max_pending}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_pending = max_pending
        self.retry_after = retry_after
        self.budget = budget
        self.waiting = 0  # requests in the waiting room
        self.active = 0  # requests with a turn
        # One room per event loop: a gate used again under another loop (or
        # backend) must not wait on the first one's.
        self._rooms: RunVar[_Room] = RunVar("mlx_pinned_batch_gate")

    @property
    def busy(self) -> bool:
        return self.active > 0

    @asynccontextmanager
    async def enter(
        self, priority: int = 0, charge: Charge | None = None
    ) -> AsyncIterator[Place]:
        """A place for the block: a turn now, or a place in the waiting room
        (``priority``: lower is sooner); charged ``charge`` under a budget.

        Raises:
            OverloadedError: ``max_pending`` requests wait already.
            MemoryBusyError: Its images do not fit the budget now.
            MemoryTooLargeError: It never fits the budget.
        """
        try:
            room = self._rooms.get()
        except LookupError:  # the first entry on this event loop
            room = _Room(self)
            self._rooms.set(room)
        queued = len(room.waiting)
        # Anyone waiting: no turn is free, or no memory for the head.
        if (room.free == 0 or queued) and queued >= self.max_pending:
            raise OverloadedError(queued, retry_after=self.retry_after)
        charge = charge or Charge()
        if self.budget is not None:
            self.budget.check_entry(charge)
        place = Place(priority, next(room.arrivals), charge, room=room)
        room.enter(place)
        try:
            yield place
        finally:
            room.leave(place)

    @asynccontextmanager
    async def turn(
        self, priority: int = 0, charge: Charge | None = None
    ) -> AsyncIterator[None]:
        """Hold a turn for the block (``priority``: lower is sooner), charged
        ``charge``. Cancelling the caller while it waits gives up its place.

        Raises:
            OverloadedError: ``max_pending`` requests wait already.
            MemoryTooLargeError: It never fits the budget.
        """
        async with self.enter(priority, charge) as place:
            await place.turn()
            yield
