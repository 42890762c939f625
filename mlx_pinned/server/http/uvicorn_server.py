"""uvicorn's server as ``mlx-pinned serve`` runs it: it answers while the
models load; on SIGTERM it turns ``/health`` to 503 for ``--unready-seconds``
before it closes its listener, and ends the answers still running
``--in-flight-timeout`` later in their APIs' words. It offers the app a way
to close a connection at once (:data:`.outbox.ABORT`), and says when the
open connections near the process's descriptor limit.

Event loop (the main thread); uvicorn calls :meth:`Server.handle_exit` from
its signal handler, on the loop's thread between two callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.lifespan.on import LifespanOn

from .errors import shutting_down
from .health import Readiness
from .outbox import ABORT, Outbox

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LAST_WRITES", "Server"]

logger = logging.getLogger("mlx_pinned.server")

#: Seconds the answers ended at a shutdown get to be read, at most.
LAST_WRITES = 3.0
#: Descriptors kept apart from connections when the limit is near (the
#: process's own files, a model's, a fetch's).
_SPARE_DESCRIPTORS = 16


class Server(uvicorn.Server):
    """uvicorn's Server for sockets that listen before the models load:
    meanwhile ``/livez`` answers 200 and the rest 503 ``model_not_loaded``.
    uvicorn's ``Uvicorn running on URL`` is logged once the models are
    loaded; a failed load stops the server and sets :attr:`load_failed`.

    The first SIGTERM or SIGINT turns readiness off; when the server was
    ready it keeps serving ``unready_seconds`` more, then shuts down as
    uvicorn does. A second signal ends the wait. ``in_flight_timeout``
    seconds into the shut-down, the answers under way in ``outbox`` are
    ended (set uvicorn's ``timeout_graceful_shutdown`` longer, by
    :data:`LAST_WRITES` and more).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        readiness: Readiness,
        unready_seconds: float,
        outbox: Outbox | None = None,
        in_flight_timeout: float = 30.0,
    ) -> None:
        super().__init__(config)
        self.readiness = readiness
        self.unready_seconds = unready_seconds
        self.outbox = outbox
        self.in_flight_timeout = in_flight_timeout
        self.load_failed = False
        # Connections before the descriptor limit, and the limit.
        self._room: tuple[int, int] | None = None
        self._short = False  # warned that descriptors run short
        self._url: str | None = None
        self._drain_ends: float | None = None
        self._signal: tuple[int, FrameType | None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        lifespan = _LoadWhileServing(self.config, self._loaded)
        self.lifespan = lifespan
        self.config.loaded_app = _Abortable(self.config.loaded_app)
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().startup(sockets)
        if not self.started:
            return
        if sockets:
            host, port = sockets[0].getsockname()[:2]
            self._url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            logger.info("listening on %s while the models load", self._url)
        lifespan.begin()

    def _loaded(self, failed: bool) -> None:
        if failed:
            self.load_failed = True
            self.should_exit = True
            return
        self._room = _connection_room()
        if self._url is not None and not self.should_exit:
            # As uvicorn logs it for a socket of its own, but once the server
            # is ready: scripts wait for this line.
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s (Press CTRL+C to quit)", self._url
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signal is not None:  # a second signal: no more waiting
            self._signal = None
        elif not self.should_exit and self._drain_wanted():
            self.readiness.drain()
            self._signal = (sig, frame)
            self._drain_ends = time.monotonic() + self.unready_seconds
            logger.info(
                "draining: /health answers 503 for %.1f s, then the listener "
                "closes (a second signal skips the wait)",
                self.unready_seconds,
            )
            return
        self.readiness.drain()
        super().handle_exit(sig, frame)

    def _drain_wanted(self) -> bool:
        # A balancer may be sending here only if the server was ready.
        if self.unready_seconds <= 0 or not self.started:
            return False
        return self.readiness.refusal() is None

    async def on_tick(self, counter: int) -> bool:
        ends = self._drain_ends
        if self._signal is not None and ends is not None and time.monotonic() >= ends:
            sig, frame = self._signal
            self._signal = None
            super().handle_exit(sig, frame)
        if counter % 10 == 0:
            self._watch_descriptors()
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        ending = loop.call_later(self.in_flight_timeout, self._end_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    def _end_in_flight(self) -> None:
        if self.outbox is None or not self.outbox.open:
            return
        ended = self.outbox.end(shutting_down(), LAST_WRITES)
        logger.warning(
            "%d requests still running %.1f s into the shut-down "
            "(--in-flight-timeout): ending them with an error",
            ended,
            self.in_flight_timeout,
        )

    def _watch_descriptors(self) -> None:
        """One warning each time the open connections near the descriptor
        limit: past it new connections are reset, and nothing else says so."""
        if self._room is None:
            return
        room, limit = self._room
        connections = len(self.server_state.connections)
        if connections >= room and not self._short:
            self._short = True
            logger.warning(
                "%d connections open: near the process's limit of %d open files, "
                "past which new connections are reset; raise it (ulimit -n, "
                "systemd's LimitNOFILE=) or cap connections in front of the server",
                connections,
                limit,
            )
        elif connections < room * 0.9:
            self._short = False

    def _loop_error(
        self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]
    ) -> None:
        # asyncio's own loop (not uvloop) reports the accept's EMFILE with a
        # traceback each time: the watch above says it once.
        if context.get("message") == "socket.accept() out of system resource":
            return
        loop.default_exception_handler(context)


class _LoadWhileServing(LifespanOn):
    """uvicorn's lifespan, whose start-up (the model loads) runs in a task
    once the server listens; ``loaded(failed)`` is called when it ends. The
    shut-down waits for a load still running: it cannot be cut short."""

    def __init__(self, config: uvicorn.Config, loaded: Callable[[bool], None]):
        super().__init__(config)
        self._loaded = loaded
        self._loading: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        """Nothing yet: uvicorn awaits this before it serves; :meth:`begin`
        starts the load once it does."""

    def begin(self) -> None:
        self._loading = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        await super().startup()
        self._loaded(self.should_exit)

    async def shutdown(self) -> None:
        if self._loading is not None:
            await self._loading
        await super().shutdown()


class _Abortable:
    """The app, offered :data:`.outbox.ABORT` on each HTTP request: close its
    connection now, what is unwritten dropped (uvicorn's own close waits
    for a client that reads nothing)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # uvicorn's send is a method of the request's cycle, which holds the
        # connection's transport.
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and transport is not None:
            scope.setdefault("extensions", {})[ABORT] = {"abort": transport.abort}
        await self.app(scope, receive, send)


def _connection_room() -> tuple[int, int] | None:
    """Connections that fit under the descriptor limit besides the files
    open now, and the limit (None: they cannot be counted here)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
        open_now = len(os.listdir(folder))
    except (ImportError, OSError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    return max(limit - open_now - _SPARE_DESCRIPTORS, 1), limit
