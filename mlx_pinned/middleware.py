"""MLXThreadMiddleware: ties an MLXThread to an ASGI app's lifespan.

Pure ASGI, so it works under Starlette, FastAPI or a bare ASGI app. Add it
inside the framework's error handling so it sees the app's exceptions::

    app = Starlette(routes=..., middleware=[
        Middleware(MLXThreadMiddleware, startup={"model": load_model}),
    ])

Its code runs on the event loop; start-up jobs run on the MLX thread (through
:func:`~mlx_pinned.mlx_lifespan`, which starts and stops it).
"""

from __future__ import annotations

import enum
import functools
import logging
import sys

import anyio

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

from ._exceptions import (
    MLXPinnedError,
    MLXThreadBrokenError,
    MLXThreadBusyError,
    ShuttingDownError,
)
from ._executor import MLXThread
from ._lifespan import MLXLifespan, StartupJobs, mlx_lifespan
from ._refusals import ASGIApp, Message, Receive, Refusal, Scope, Send, plain_refusal
from ._refusals import public_message as _public

__all__ = ["MLXThreadMiddleware"]

logger = logging.getLogger("mlx_pinned.middleware")


class MLXThreadMiddleware:
    """Start an MLXThread with the app, run start-up jobs on it, stop it last.

    Lifespan start-up: :func:`~mlx_pinned.mlx_lifespan` starts the thread
    and runs each ``startup`` callable on it, in order (load the model here);
    its state (the thread under ``state_key``, each result under its key) is
    put in the lifespan state (in Starlette, ``request.state.model`` and
    ``request.state.mlx_thread``). If a job fails, the server gets
    ``lifespan.startup.failed`` with the reason, and the error is re-raised
    (as Starlette's router does, so that ``TestClient`` raises it); later
    requests are refused with an ``MLXThreadBrokenError`` whose cause it is.

    Lifespan shut-down: new requests are refused with a
    :class:`~mlx_pinned.ShuttingDownError`, in-flight ones get up to
    ``drain_timeout`` seconds to finish, the app's own shut-down runs, then
    the thread shuts down.

    Requests: an mlx-pinned error (an :class:`~mlx_pinned.MLXPinnedError`)
    raised before the response started is answered by ``refusal(error)``, an
    ASGI app the middleware calls. The default answers in plain text:
    ``MLXThreadBusyError`` 503 with ``Retry-After``; ``MLXThreadClosedError``
    and ``MLXThreadBrokenError`` 503; ``StreamAffinityError`` and
    ``MLXThreadDeadlockError`` 500 with a generic message. Every one but a
    busy thread is logged with its traceback. A WebSocket is accepted and
    closed with code 1013 instead. An error after the response started is
    re-raised.

    Args:
        app: the ASGI app to wrap.
        thread: the MLXThread to manage, for one lifespan (a thread that was
            shut down cannot start again); the default thread if ``None``.
        startup: name -> callable with no arguments, run on the thread at
            start-up.
        drain_timeout: seconds in-flight requests get at shut-down.
        state_key: the lifespan-state key of the thread.
        retry_after: seconds the default refusal sends in ``Retry-After``
            when busy.
        refusal: the response to an mlx-pinned error, made by the app (in its
            own error shape); the plain-text one above if ``None``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        thread: MLXThread | None = None,
        startup: StartupJobs | None = None,
        drain_timeout: float = 30.0,
        state_key: str = "mlx_thread",
        retry_after: int = 1,
        refusal: Refusal | None = None,
    ) -> None:
        self.app = app
        self._lifespans = mlx_lifespan(
            thread=thread, startup=startup, state_key=state_key
        )
        self.thread: MLXThread | None = thread
        self.drain_timeout = drain_timeout
        self.state_key = state_key
        self.retry_after = retry_after
        self.refusal: Refusal = refusal or functools.partial(
            plain_refusal, retry_after=retry_after
        )
        self._state: dict[str, object] = {}
        # The error new requests get instead of the app: None while it serves.
        self._refused: MLXPinnedError | None = None
        self._run: MLXLifespan | None = None
        self._in_flight = 0
        self._idle: anyio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] in ("http", "websocket"):
            await self._request(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    # -- requests ------------------------------------------------------------

    async def _request(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        for key, value in self._state.items():
            state.setdefault(key, value)
        refused = self._refused
        if refused is not None:
            await self._answer(scope, receive, send, refused)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] in ("http.response.start", "websocket.accept"):
                started = True
            await send(message)

        self._in_flight += 1
        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            # Also the one error of a task group the endpoint ran (anyio's
            # groups wrap even a single error).
            error = _sole(exc)
            if started or not isinstance(error, MLXPinnedError):
                raise
            if not isinstance(error, MLXThreadBusyError):
                # For the operator: the job and thread a bug names stay out
                # of the response (see public_message).
                path = scope.get("path")
                logger.error("%s in %s", type(error).__name__, path, exc_info=error)
            await self._answer(scope, receive, send, error)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, error: MLXPinnedError
    ) -> None:
        if scope["type"] != "http":
            # Accepted first: a close before the accept is answered by the
            # server as an HTTP 403, and the client never sees code 1013.
            # A close frame carries at most 123 bytes of reason.
            reason = _public(error).encode()[:123].decode(errors="ignore")
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 1013, "reason": reason})
            return
        await self.refusal(error)(scope, receive, send)

    # -- lifespan ------------------------------------------------------------

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Start the thread, relay the app's lifespan, stop the thread.

        The app's side of the lifespan only moves forward through
        :class:`_Stage`. The app's first read gets ``lifespan.startup``
        (``STARTUP_READ``); ``lifespan.shutdown`` from the server drains the
        requests (``SHUTDOWN_ASKED``). The app's ``startup.complete`` makes it
        ``STARTED``; ``startup.failed`` stops the thread (``STARTUP_FAILED``);
        ``shutdown.*`` stops it (``FINISHED``); a message that is not a
        lifespan one raises ``_NotLifespan`` into the app. Once the app
        returns or raises an ``Exception``, by stage:

        ==============  ================================  ================
        stage           the app returned                  the app raised
        ==============  ================================  ================
        STARTUP_UNREAD  answer startup.complete for it,   the same
                        then as STARTED
        STARTUP_READ    the same                          the same, warned
        STARTED         wait for lifespan.shutdown,       the same, logged
                        drain, then as SHUTDOWN_ASKED
        SHUTDOWN_ASKED  stop, answer shutdown.complete    stop, re-raise
        FINISHED        nothing                           stop, re-raise
        STARTUP_FAILED  nothing                           stop, re-raise
        ==============  ================================  ================

        On a ``BaseException`` (cancelled) the thread is abandoned, not
        waited for, and the exception propagates.
        """
        startup = await receive()
        try:
            await self._start(scope)
        except Exception as exc:
            logger.exception("MLX thread start-up failed")
            await send({"type": "lifespan.startup.failed", "message": _reason(exc)})
            # Later requests learn why they are refused.
            failed = MLXThreadBrokenError("The server failed to start: see its log.")
            failed.__cause__ = exc
            await self._stop(failed)
            # As Starlette's router does: a server that reads on (TestClient)
            # learns the failure, instead of serving an app never started.
            raise
        except BaseException:  # cancelled, SystemExit: no thread left behind
            self._abandon()
            raise
        relay = _AppLifespan(self, startup, receive, send)
        try:
            await self.app(scope, relay.receive, relay.send)
        except Exception:
            if relay.stage >= _Stage.SHUTDOWN_ASKED:
                # Failed in or after its shut-down (drained already), or it
                # told the server its start-up failed: the server reports it.
                await self._stop()
                raise
            if relay.stage is _Stage.STARTED:
                # Failed while serving, after its start-up: the server goes
                # on, so does the thread, until the server's shut-down.
                logger.exception("the app's lifespan failed after its start-up")
            elif relay.stage is _Stage.STARTUP_READ:
                # It read the start-up message, then raised: an app whose own
                # start-up failed, or a bare app that read it as a request. A
                # server goes on as for an app without lifespan support
                # (uvicorn's "auto"); so do we, but not silently.
                logger.warning(
                    "the app raised on lifespan.startup; answering for it as "
                    "for an app without lifespan support",
                    exc_info=True,
                )
        except BaseException:
            self._abandon()
            raise
        stage = relay.stage
        if stage <= _Stage.STARTUP_READ:
            # The app does not speak lifespan (it raised or returned at once,
            # as bare ASGI apps do): answer the server for it.
            await send({"type": "lifespan.startup.complete"})
            stage = _Stage.STARTED
        if stage is _Stage.STARTED:
            # Also when it started and returned (or failed) without waiting
            # for the shutdown: the thread still stops when the server does.
            ended = await receive()
            if ended["type"] != "lifespan.shutdown":  # pragma: no cover
                return
            await self._drain()
            stage = _Stage.SHUTDOWN_ASKED
        if stage is _Stage.SHUTDOWN_ASKED:
            await self._stop()
            await send({"type": "lifespan.shutdown.complete"})

    async def _start(self, scope: Scope) -> None:
        self._refused = None
        run = self._run = self._lifespans()
        try:
            # Not __aenter__, which stops the thread itself if a job fails:
            # the server hears of the failure first.
            self._state = await run.start()
        finally:
            self.thread = run.thread
        if "state" in scope:
            scope["state"].update(self._state)

    async def _drain(self) -> None:
        self._refused = _shutting_down()
        if self._in_flight:
            self._idle = anyio.Event()
            with anyio.move_on_after(self.drain_timeout) as timeout:
                await self._idle.wait()
            if timeout.cancelled_caught:
                logger.warning(
                    "%d requests still running after %.1f s; shutting down",
                    self._in_flight,
                    self.drain_timeout,
                )

    async def _stop(self, refused: MLXPinnedError | None = None) -> None:
        self._refused = refused or _shutting_down()
        if self._run is not None:
            await self._run.aclose()

    def _abandon(self) -> None:
        self._refused = _shutting_down()
        if self._run is not None:
            self._run.abandon()


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one, else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class _Stage(enum.IntEnum):
    """How far the app's side of one lifespan has come; see ``_lifespan``."""

    STARTUP_UNREAD = 0  # the app has not read lifespan.startup
    STARTUP_READ = 1  # it read it and has not answered
    STARTED = 2  # it answered lifespan.startup.complete
    SHUTDOWN_ASKED = 3  # the server sent lifespan.shutdown
    FINISHED = 4  # the app answered the shut-down
    STARTUP_FAILED = 5  # it answered lifespan.startup.failed: nothing follows


class _AppLifespan:
    """The receive and send one lifespan gives the app, and its stage."""

    def __init__(
        self,
        middleware: MLXThreadMiddleware,
        startup: Message,
        receive: Receive,
        send: Send,
    ) -> None:
        self.stage = _Stage.STARTUP_UNREAD
        self._middleware = middleware
        self._startup = startup
        self._receive = receive
        self._send = send

    def _advance(self, stage: _Stage) -> None:
        # Forward only: a late or repeated message never undoes a stage.
        self.stage = max(self.stage, stage)

    async def receive(self) -> Message:
        if self.stage is _Stage.STARTUP_UNREAD:
            self.stage = _Stage.STARTUP_READ
            return self._startup  # read from the server before the thread started
        message = await self._receive()
        if message["type"] == "lifespan.shutdown":
            self._advance(_Stage.SHUTDOWN_ASKED)
            await self._middleware._drain()
        return message

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if not kind.startswith("lifespan."):
            # A bare app that took the start-up message for a request.
            raise _NotLifespan(kind)
        if kind == "lifespan.startup.failed":
            self._advance(_Stage.STARTUP_FAILED)
            await self._middleware._stop()
        elif kind.startswith("lifespan.startup."):
            self._advance(_Stage.STARTED)
        elif kind.startswith("lifespan.shutdown."):
            self._advance(_Stage.FINISHED)
            await self._middleware._stop()
        await self._send(message)


class _NotLifespan(Exception):
    """Raised into an app that sent a non-lifespan message in a lifespan."""


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _shutting_down() -> ShuttingDownError:
    return ShuttingDownError("The server is shutting down.")
