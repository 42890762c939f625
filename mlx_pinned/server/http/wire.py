"""The HTTP side of a request, the same for every API: body, response,
disconnects, log line, server-sent events, fresh ids.

Plain ASGI, on the event loop; nothing here knows a model or an API's shapes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from ..events import FinalEvent, TokenEvent
from .errors import OPENAI_ERRORS, APIError, ErrorShape
from .outbox import ResponseWriter

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Scope

__all__ = [
    "DRAIN_FACTOR",
    "DRAIN_SECONDS",
    "KEEP_ALIVE",
    "OPENAI_ERRORS",
    "Body",
    "Disconnected",
    "ErrorShape",
    "Opening",
    "RequestLog",
    "ResponseWriter",
    "cancel_on_disconnect",
    "random_hex",
    "read_body",
    "sse_event",
    "watch_disconnect",
]

logger = logging.getLogger("mlx_pinned.server")


@dataclass
class RequestLog:
    """What the one log line of a request reports."""

    start: float
    route: str  # the method and path, as logged: "POST /v1/chat/completions"
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
    model: str | None = None  # the served model's name, once the request named one
    api: str | None = None  # the door's per-model series (None: it has none)

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
            "%s%s %d stream=%s images=%d prompt=%d "
            "completion=%d queue=%.1fms ttft=%.1fms total=%.1fms %.1f tok/s "
            "finish=%s model=%s%s",
            f"{self.client} " if self.client else "",
            self.route,
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
            self.model or "-",
            " (client disconnected)" if self.disconnected else "",
        )


class Disconnected(Exception):
    """The client left before its request body was read."""


#: A body over the limit is still read (and dropped) up to this many times
#: the limit and for this many seconds before the 413 is sent.
DRAIN_FACTOR = 4
DRAIN_SECONDS = 5.0


class Body(bytes):
    """A request body, and the media type its ``Content-Type`` declares
    (with its parameters: a multipart form's boundary)."""

    content_type: str

    def __new__(cls, data: bytes, content_type: str = "") -> Body:
        body = super().__new__(cls, data)
        body.content_type = content_type
        return body


async def read_body(scope: Scope, receive: Receive, limit: int) -> Body:
    """The request body, refused with 413 once it passes ``limit``.

    Before the 413, the rest is read and dropped (within :data:`DRAIN_FACTOR`
    times the limit and :data:`DRAIN_SECONDS`): a client that sends its whole
    body before it reads (``urllib``, ``requests``) would otherwise find the
    connection reset instead of the answer.
    """
    too_large = APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )
    drain = limit * DRAIN_FACTOR
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        if int(length) <= drain:
            await _drain(receive, drain)
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        body = message.get("body", b"")
        size += len(body)
        more = message.get("more_body", False)
        if size > limit:
            if more:
                await _drain(receive, drain - size)
            raise too_large
        chunks.append(body)
        if not more:
            declared = headers.get(b"content-type", b"").decode("latin-1")
            return Body(b"".join(chunks), declared)


async def _drain(receive: Receive, budget: int) -> None:
    with anyio.move_on_after(DRAIN_SECONDS):
        while budget >= 0:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            budget -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return


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
            if not response.ended and response.closed is None:
                log.disconnected = True
                scope.cancel()
            return


@asynccontextmanager
async def cancel_on_disconnect(
    receive: Receive,
    scope: anyio.CancelScope,
    response: ResponseWriter,
    log: RequestLog,
) -> AsyncIterator[None]:
    """Run :func:`watch_disconnect` beside the block; stop it at the end.

    On asyncio the watcher is a bare task, cancelled without waiting for it:
    an anyio task group per request costs the event loop far more.
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


@dataclass(frozen=True)
class Opening:
    """How a stream begins before its answer's first piece: its API's
    opening events (``head``), what it sends while nothing else comes
    (``keep_alive``: a ping, a comment), how a failure ends it (None: its
    API's error event) and its media type (None: server-sent events)."""

    head: bytes
    keep_alive: bytes
    failed: Callable[[APIError], bytes] | None = None
    media_type: bytes | None = None


#: An SSE comment: clients skip it; it keeps a waiting stream alive.
KEEP_ALIVE = b": keep-alive\n\n"


def sse_event(data: Any, *, event: str | None = None) -> bytes:
    """``data`` as one server-sent event of compact JSON, with an ``event:``
    line first when ``event`` is given."""
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if event is None:
        return f"data: {body}\n\n".encode()
    return f"event: {event}\ndata: {body}\n\n".encode()


# Fresh random ids for answers, items and tool calls: unique, not secret.
# One generator seeded from the OS per process (forks re-seeded), not a
# system call per id, which on the event loop would also give up the GIL.
_ids = random.Random(os.urandom(16))
if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(16)))


def random_hex(bits: int) -> str:
    return f"{_ids.getrandbits(bits):0{bits // 4}x}"
