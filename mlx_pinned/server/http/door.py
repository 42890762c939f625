"""A door: one API route that serves a kind of model, and the one skeleton
every door runs (:meth:`Door.handle`).

Event loop only. A door fills in the steps and never formats an error: its
API's one table (:attr:`Door.errors`) answers every failure. The engine's
work that can fail (prefill) runs before a stream starts, so a bad request
is a 4xx, never a 200 that carries an error. One deadline
(``request_timeout``) covers everything after the body was read; past it
the answer is a 504 and the engine's work is closed. The answer is written
from its own buffer (:mod:`.outbox`): the gate's turn ends with the run,
however slowly the client reads.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import anyio
from starlette.routing import Route

from ..kinds import kind_named
from .errors import APIError, internal_error, thread_unavailable, timed_out
from .gate import Charge, Place
from .outbox import Outbox, ResponseWriter, abort_of
from .takeover import Takeovers, Ticket
from .wire import (
    OPENAI_ERRORS,
    Body,
    Disconnected,
    ErrorShape,
    Opening,
    RequestLog,
    cancel_on_disconnect,
    read_body,
)

if TYPE_CHECKING:
    from PIL import Image
    from starlette.types import Receive, Scope, Send

    from mlx_pinned import MLXThread

    from ..config import ServerConfig
    from ..media import Decoders, ImageRef
    from .metrics import ServerMetrics
    from .residency import Residency
    from .served_models import ServedModel, ServedModels
    from .turns import LoopTurns

__all__ = ["Call", "Door", "Named", "Wiring", "routes"]

logger = logging.getLogger("mlx_pinned.server")


class Named(Protocol):
    """What the skeleton reads of every door's parsed request."""

    @property
    def model(self) -> str:
        """The served model it names."""
        ...


RequestT = TypeVar("RequestT", bound=Named)
EngineT = TypeVar("EngineT")
PreparedT = TypeVar("PreparedT")
OutputT = TypeVar("OutputT")


@dataclass(frozen=True, slots=True)
class Wiring:
    """What every door is built with (``app.py`` makes one); a door that
    opens something adds its close to ``closing``, run at shut-down."""

    config: ServerConfig
    thread: MLXThread
    models: ServedModels
    residency: Residency
    turns: LoopTurns
    decoders: Decoders
    metrics: ServerMetrics | None = None
    outbox: Outbox = field(default_factory=Outbox)
    takeovers: Takeovers = field(default_factory=Takeovers)
    closing: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Call(Generic[RequestT, EngineT, PreparedT]):
    """One request as a door's steps after its entry at the gate see it:
    its ``place`` there, and how its stream opens (None: unstreamed, or
    with its first piece)."""

    request: RequestT
    served: ServedModel
    engine: EngineT
    prepared: PreparedT
    response: ResponseWriter
    log: RequestLog
    place: Place
    opening: Opening | None = None


class Door(ABC, Generic[RequestT, EngineT, PreparedT, OutputT]):
    """The ASGI endpoint of one API route.

    A client that disconnects, while waiting or while its engine runs,
    cancels its request: work that has not started never starts, running
    work is closed on the MLX thread.

    Attributes:
        route: The method and path, for the log line (and its route).
        paths: Its paths, where it has more than the route's.
        prompt: The request's part a refused prompt or input is named by.
        api: Its label in the per-model metrics (None: it has none).
    """

    route: ClassVar[str]
    paths: ClassVar[tuple[str, ...]] = ()
    kind: ClassVar[str] = "chat"
    errors: ClassVar[ErrorShape] = OPENAI_ERRORS
    prompt: ClassVar[str] = "messages"
    gated: ClassVar[bool] = True
    api: ClassVar[str | None] = None

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.config = wiring.config
        # The kind's engine protocol: the one check that types the engine.
        self.protocol: type[EngineT] = kind_named(self.kind).protocol

    # -- the steps a door fills in ------------------------------------------

    @abstractmethod
    async def parse(self, body: Body, places: list[str]) -> RequestT:
        """The request in ``body``; where each of its media parts is, in
        prompt order per kind, added to ``places`` (to name a refused one)."""

    def streamed(self, request: RequestT) -> bool:
        """Whether the answer is written as it is made (else whole)."""
        return False

    @abstractmethod
    async def prepare(self, request: RequestT, engine: EngineT) -> PreparedT:
        """``request`` checked against its model (before any wait for the
        gate), as the engine takes it."""

    async def media(
        self, prepared: PreparedT, engine: EngineT, log: RequestLog
    ) -> PreparedT:
        """``prepared`` with its media decoded off the loop (none here)."""
        return prepared

    async def decode_images(
        self, refs: Sequence[ImageRef], log: RequestLog
    ) -> tuple[Image.Image, ...]:
        """A request's images, decoded off the loop (counted in ``log``)."""
        log.images = len(refs)
        return tuple(await self.wiring.decoders.images(refs))

    def admission(
        self, served: ServedModel, engine: EngineT, prepared: PreparedT
    ) -> AbstractAsyncContextManager[Place]:
        """A place at the model's gate for the block, charged what
        :meth:`charge` says; one with its turn where the door is not
        :attr:`gated`. The gate's refusal raises here, before any byte."""
        if not self.gated:
            return _ungated()
        charge = self.charge(prepared, engine)
        return served.gate.enter(self.priority(prepared), charge)

    def priority(self, prepared: PreparedT) -> int:
        """Its place at the gate: the lowest waiting is admitted first."""
        return 0

    def charge(self, prepared: PreparedT, engine: EngineT) -> Charge:
        """The bytes it will hold, as the gate prices them (none here)."""
        return Charge()

    def opening(self, call: Call[RequestT, EngineT, PreparedT]) -> Opening | None:
        """How its stream opens before the first piece of its answer (None:
        with it, its status then waiting for it)."""
        return None

    @abstractmethod
    def run(
        self, call: Call[RequestT, EngineT, PreparedT]
    ) -> AbstractAsyncContextManager[OutputT]:
        """The engine's work for ``call``, closed on the MLX thread when the
        block ends, however it ends."""

    @abstractmethod
    async def send_whole(
        self, call: Call[RequestT, EngineT, PreparedT], output: OutputT
    ) -> None:
        """Write the whole answer."""

    async def send_stream(
        self, call: Call[RequestT, EngineT, PreparedT], output: OutputT
    ) -> None:
        """Write the answer as it is made (the status with its first piece,
        so a failure before it is still an error status)."""
        await self.send_whole(call, output)

    # -- the skeleton -------------------------------------------------------

    async def handle(
        self, body: Body, response: ResponseWriter, log: RequestLog, places: list[str]
    ) -> None:
        """parse -> resident -> prepare -> media -> gate -> run -> write."""
        request = await self.parse(body, places)
        await self.serve(request, response, log)

    async def serve(
        self, request: RequestT, response: ResponseWriter, log: RequestLog
    ) -> None:
        """resident -> prepare -> media -> gate -> run -> write."""
        log.stream = self.streamed(request)
        async with self.resident(request.model, log) as (served, engine):
            prepared = await self.prepare(request, engine)
            prepared = await self.media(prepared, engine, log)
            arrived = time.perf_counter()
            async with self.admission(served, engine, prepared) as place:
                call = Call(request, served, engine, prepared, response, log, place)
                if log.stream:
                    call = replace(call, opening=self.opening(call))
                every = self.config.heartbeat_interval
                if call.opening is not None and every:
                    response.expect_stream(call.opening, every)
                await place.turn()
                if self.gated:
                    log.queued = time.perf_counter() - arrived
                async with self.run(call) as output:
                    if log.stream:
                        await self.send_stream(call, output)
                    else:
                        await self.send_whole(call, output)

    @asynccontextmanager
    async def resident(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, EngineT]]:
        """The model served as ``name`` and its engine, held for the block
        (loaded first if needed; never unloaded under it); a 404 for a model
        not served, a 400 for one of another kind."""
        served = self.wiring.models.get(name)
        log.model = served.name
        served.check_kind(self.kind, self.route.partition(" ")[2])
        async with self.wiring.residency.use(served) as engine:
            if not isinstance(engine, self.protocol):
                raise TypeError(f"{served.name}'s engine is not a {self.kind} engine")
            yield served, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = RequestLog(
            start=time.perf_counter(),
            client=_client(scope),
            route=self.route,
            api=self.api,
        )
        outbox = self.wiring.outbox
        ticket = self._ticket(scope, send)
        if ticket is not None:
            send = ticket.send
        response = ResponseWriter(send, self.errors, outbox, abort_of(scope))
        outbox.open.add(response)
        try:
            await self.wiring.turns.checkpoint()
            body = await read_body(scope, receive, self.config.max_body_bytes)
            timeout = self.config.request_timeout
            deadline = anyio.current_time() + timeout if timeout else math.inf
            # One scope: the deadline cancels it, and so do the watcher when
            # the client goes away (it marks the log first), the writer when
            # the client reads too slowly, and a shutdown.
            with anyio.CancelScope(deadline=deadline) as limit:
                response.running(limit)
                if ticket is not None:
                    receive = ticket.watch(receive)
                async with cancel_on_disconnect(receive, limit, response, log):
                    await self._answer(body, response, log, ticket)
            if limit.cancelled_caught and not log.disconnected:
                await response.error(response.ending or timed_out(timeout))
        except Disconnected:
            log.disconnected = True
        except APIError as error:
            await response.error(error)
        finally:
            try:  # the gate's turn is given back: what is left is its client's
                await response.finish()
            finally:
                outbox.open.discard(response)
                if ticket is not None:
                    ticket.close()
            if response.closed is not None:
                logger.warning(
                    "closed the connection of %s (%s): %s",
                    log.client or "a client",
                    log.route,
                    response.closed,
                )
            log.status = response.status or (499 if log.disconnected else 0)
            log.emit()
            if self.wiring.metrics is not None:
                self.wiring.metrics.observe(log)

    def _ticket(self, scope: Scope, send: Send) -> Ticket | None:
        """The request's ticket under its ``Idempotency-Key`` (None: it has
        none)."""
        for name, value in scope["headers"]:
            if name == b"idempotency-key":
                key = value.decode("latin-1")
                return Ticket(self.wiring.takeovers, self.route, key, send)
        return None

    async def _answer(
        self,
        body: Body,
        response: ResponseWriter,
        log: RequestLog,
        ticket: Ticket | None = None,
    ) -> None:
        """Handle the request; every error becomes an answer (none escapes).
        A keyed request may take its answer over from a run under way."""
        places: list[str] = []
        try:
            if self.wiring.thread.closed:  # fail fast: nothing will ever run
                raise thread_unavailable()
            if ticket is not None and await ticket.answered(body, response):
                return
            await self.handle(body, response, log, places)
        except Exception as exc:
            error = self.errors.answer(
                exc,
                retry_after=self.config.retry_after,
                places=places,
                prompt=self.prompt,
            )
            if error is None:
                logger.exception("%s failed", self.route)
                error = internal_error()
            elif error.status == 500:  # the body names nothing: the log does
                logger.error("%s failed", self.route, exc_info=exc)
            await response.error(error)


@asynccontextmanager
async def _ungated() -> AsyncIterator[Place]:
    place = Place(0, 0, Charge())
    place.ready.set()
    yield place


def routes(*doors: Door[Any, Any, Any, Any]) -> list[Route]:
    found = []
    for door in doors:
        method, _, path = door.route.partition(" ")
        found += [Route(p, door, methods=[method]) for p in door.paths or (path,)]
    return found


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""
