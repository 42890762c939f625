"""The HTTP side of a chat request: body, response, disconnects, log line.

Plain ASGI, on the event loop. Nothing here knows about models.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import sniffio

from ._errors import APIError
from .engine import FinalEvent, TokenEvent

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Scope, Send

__all__ = [
    "Disconnected",
    "LoopTurns",
    "RequestLog",
    "ResponseWriter",
    "disconnect_watch",
    "read_body",
    "watch_disconnect",
]

logger = logging.getLogger("mlx_pinned.server")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass
class RequestLog:
    """What the one log line of a request reports."""

    start: float
    status: int = 0
    stream: bool = False
    images: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued: float | None = None  # seconds waited for the model, once it got it
    first_token: float | None = None
    last_token: float | None = None
    finish: str = "-"
    disconnected: bool = False
    client: str = ""  # host:port, from a trusted proxy's X-Forwarded-For

    def record(self, event: TokenEvent | FinalEvent, *, whole: bool = False) -> None:
        """Count ``event`` as it reaches the event loop; ``whole``: the events
        came together at the end (a non-streamed answer), so the first token's
        time is taken from the engine's decode time instead."""
        if isinstance(event, TokenEvent):
            self.completion_tokens += 1
            if not whole:
                now = time.perf_counter()
                self.first_token = self.first_token or now
                self.last_token = now
            return
        self.prompt_tokens = event.prompt_tokens
        self.completion_tokens = event.completion_tokens
        self.finish = event.finish_reason
        if whole and event.completion_tokens:
            self.last_token = time.perf_counter()
            self.first_token = self.last_token - event.decode_seconds

    def emit(self) -> None:
        end = time.perf_counter()
        ttft = (self.first_token - self.start) * 1e3 if self.first_token else 0.0
        decode = (self.last_token or end) - (self.first_token or end)
        rate = (self.completion_tokens - 1) / decode if decode > 0 else 0.0
        logger.info(
            "%sPOST /v1/chat/completions %d stream=%s images=%d prompt=%d "
            "completion=%d queue=%.1fms ttft=%.1fms total=%.1fms %.1f tok/s "
            "finish=%s%s",
            f"{self.client} " if self.client else "",
            self.status,
            int(self.stream),
            self.images,
            self.prompt_tokens,
            self.completion_tokens,
            (self.queued or 0.0) * 1e3,
            ttft,
            (end - self.start) * 1e3,
            rate,
            self.finish,
            " (client disconnected)" if self.disconnected else "",
        )


class Disconnected(Exception):
    """The client left before its request body was read."""


class ResponseWriter:
    """The response side of one request: a status is sent once, first."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0
        self.started = False
        self.ended = False

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        await self._send(
            {"type": "http.response.start", "status": status, "headers": headers}
        )
        # Only once sent: a send that waits (the client reads nothing) and is
        # cancelled there sent nothing, so an error still gets a status line.
        self.started = True

    async def json(
        self, body: bytes, status: int = 200, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        length = (b"content-length", str(len(body)).encode())
        await self._start(status, [*_JSON_HEADERS, length, *extra])
        await self.send(body, more=False)

    async def start_stream(self, first: bytes) -> None:
        await self._start(200, _SSE_HEADERS)
        await self.send(first)

    async def send(self, body: bytes, *, more: bool = True) -> None:
        await self._send(
            {"type": "http.response.body", "body": body, "more_body": more}
        )
        self.ended = not more

    async def end(self) -> None:
        if self.started and not self.ended:
            await self.send(b"", more=False)

    async def error(self, error: APIError) -> None:
        """An error response, or an error event if the stream already began."""
        body = json.dumps(error.body()).encode()
        if error.status >= 500:
            logger.warning("answering %d: %s", error.status, error.message)
        try:
            if not self.started:
                headers = [
                    (k.lower().encode(), v.encode()) for k, v in error.headers.items()
                ]
                await self.json(body, error.status, headers)
            elif not self.ended:
                await self.send(b"data: " + body + b"\n\n", more=False)
        except OSError:  # the client is gone; nothing left to tell it
            pass


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit``."""
    too_large = APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise too_large
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def watch_disconnect(
    receive: Receive,
    scope: anyio.CancelScope,
    response: ResponseWriter,
    log: RequestLog,
) -> None:
    """Cancel the request when its client disconnects before the answer ends."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not response.ended:
                log.disconnected = True
                scope.cancel()
            return


@asynccontextmanager
async def disconnect_watch(
    receive: Receive,
    scope: anyio.CancelScope,
    response: ResponseWriter,
    log: RequestLog,
) -> AsyncIterator[None]:
    """Run :func:`watch_disconnect` beside the block; stop it at the end.

    On asyncio the watcher is a bare task, cancelled at the end without
    waiting for it: an anyio task group costs the event loop ~180 us a
    request here (a bare task ~10 us), and 32 requests arriving together
    paid that in one stretch of the loop. Elsewhere (trio), a task group.
    """
    if sniffio.current_async_library() != "asyncio":
        async with anyio.create_task_group() as group:
            group.start_soon(watch_disconnect, receive, scope, response, log)
            try:
                yield
            finally:
                group.cancel_scope.cancel()
        return
    task = asyncio.get_running_loop().create_task(
        watch_disconnect(receive, scope, response, log)
    )
    task.add_done_callback(_watcher_done)
    try:
        yield
    finally:
        task.cancel()


def _watcher_done(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("the disconnect watcher failed", exc_info=error)


class LoopTurns:
    """Share the event loop fairly when many requests are ready at once.

    asyncio runs every callback that was ready when a loop iteration began
    before it polls its sockets again. When 32 streams end on the same
    decode step and 32 new requests arrive together, that is ~25 ms of
    Python in one iteration here, and every other request (``GET /health``,
    a new arrival, a disconnect) waits for all of it. A request that calls
    :meth:`checkpoint` between its pieces of work yields to the loop once
    the loop's current busy stretch has run longer than ``budget`` seconds:
    the loop polls its sockets, and whatever arrived runs before the rest of
    the stretch. The work is the same, cut into slices of ``budget``.

    A stretch starts at the first checkpoint after the loop last polled: the
    first checkpoint queues a marker callback, which runs after the next
    poll. Whoever waits goes first, in order: a request over the budget, or
    arriving while others wait, joins the line; the first in line goes on
    once a new stretch has room, and hands the turn to the next as it goes.
    A lone stream never yields (it pays a clock read and one marker a
    checkpoint). Requests that never call :meth:`checkpoint` (``/health``)
    never wait behind the slices. asyncio only (uvloop included); elsewhere
    :meth:`checkpoint` returns at once.

    Args:
        budget: Seconds of checkpointed work per loop iteration.
    """

    def __init__(self, budget: float = 0.0005) -> None:
        self.budget = budget
        self.yields = 0  # how often a checkpoint gave the loop away
        self._since = 0.0  # start of the current busy stretch
        # The loop whose stretch is open (its marker has not run yet); a
        # loop that closed with its marker pending leaves it here, so the
        # check is "is it this loop", never "is one open".
        self._marked: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the line's loop
        self._line: deque[asyncio.Future[None]] = deque()  # who waits, in order

    async def checkpoint(self) -> None:
        """Yield to the event loop if this stretch has used up its budget, or
        if others already wait for their turn (they go first)."""
        loop = asyncio._get_running_loop()
        if loop is None:  # trio, or no event loop
            return
        if self._marked is not loop:
            if sniffio.current_async_library() != "asyncio":
                return
            if self._loop is not loop:  # first use, or another loop: afresh
                self._loop, self._line = loop, deque()
            self._open(loop)
            if not self._line:
                return
        elif not self._line and time.perf_counter() - self._since <= self.budget:
            return
        # Wait in line: behind the others, then (first in line) for a
        # stretch with room. Only the first in line re-checks each loop
        # iteration; the others wait for their turn without waking.
        line = self._line
        turn = loop.create_future()
        line.append(turn)
        try:
            if len(line) > 1:
                self.yields += 1
                await turn
            while True:
                if self._marked is not loop:
                    self._open(loop)
                    return
                if time.perf_counter() - self._since <= self.budget:
                    return
                self.yields += 1
                await asyncio.sleep(0)
        finally:
            if line[0] is turn:  # the next one is first in line now
                line.popleft()
                if line and not line[0].done():
                    line[0].set_result(None)
            else:  # cancelled while waiting behind others
                line.remove(turn)

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open a stretch; its marker runs after the loop's next poll."""
        self._marked = loop
        self._since = time.perf_counter()
        loop.call_soon(self._unmark, loop)

    def _unmark(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._marked is loop:
            self._marked = None
