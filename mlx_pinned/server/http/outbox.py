"""What an answer keeps while its client reads slower than it is made.

A :class:`ResponseWriter` queues its messages and a task of its own writes
a stream's out, so a door's run never waits on its client: the gate's turn
ends with the generation. The :class:`Outbox` bounds the bytes so kept, per
answer and in all, closes the connection of a client that reads nothing
for ``write_timeout`` seconds, and ends every answer at a shutdown.

Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from .errors import OPENAI_ERRORS, APIError, ErrorShape

if TYPE_CHECKING:
    from starlette.types import Message, Scope, Send

    from ..config import ServerConfig
    from .wire import Opening

__all__ = ["ABORT", "Outbox", "ResponseWriter", "abort_of", "spawn"]

logger = logging.getLogger("mlx_pinned.server")

#: The ASGI extension ``serve``'s server offers: ``{"abort": callable}``
#: closes the request's connection at once, unwritten bytes and all.
ABORT = "mlx_pinned.abort"

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_writers: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references


def abort_of(scope: Scope) -> Callable[[], None] | None:
    """The server's way to close ``scope``'s connection (None: it has none)."""
    extension = scope.get("extensions", {}).get(ABORT)
    return None if extension is None else extension.get("abort")


class Outbox:
    """The answers under way, and the bounds on what they keep unwritten:
    ``answer_bytes`` a streamed answer (past them its connection is closed),
    ``total_bytes`` all (past them the stream that keeps the most is), and
    ``write_timeout`` seconds a client may read nothing while its answer
    has more to send (None: no limit)."""

    def __init__(
        self,
        *,
        answer_bytes: float = math.inf,
        total_bytes: float = math.inf,
        write_timeout: float | None = None,
    ) -> None:
        self.answer_bytes = answer_bytes
        self.total_bytes = total_bytes
        self.write_timeout = math.inf if write_timeout is None else write_timeout
        self.kept = 0  # bytes queued, not yet written, over every answer
        self.open: set[ResponseWriter] = set()
        self.ending: APIError | None = None  # the shutdown's error, once it came
        self.last_write = math.inf  # the time (monotonic) writes end at

    @classmethod
    def of(cls, config: ServerConfig) -> Outbox:
        seqs = sum(config.for_model(i).max_num_seqs for i in range(len(config.models)))
        return cls(
            answer_bytes=config.write_buffer_bytes,
            total_bytes=config.write_buffer_bytes * seqs,
            write_timeout=config.write_timeout,
        )

    def end(self, error: APIError, grace: float) -> int:
        """End every answer under way with ``error`` in its API's words
        (those not begun, the error's status), and give what is unwritten
        ``grace`` more seconds; the number of answers ended."""
        self.ending = error
        self.last_write = time.monotonic() + grace
        for writer in self.open:
            writer.interrupt()
        return len(self.open)

    def _over(self) -> None:
        """Close streams, those keeping the most first, until the total fits."""
        while self.kept > self.total_bytes:
            streams = [w for w in self.open if w.streaming and w.kept]
            if not streams:
                return
            most = max(streams, key=lambda writer: writer.kept)
            most.close(
                f"the answers kept {self.kept} unread bytes, more than "
                "--write-buffer-bytes times --max-num-seqs; this one kept the most"
            )


class ResponseWriter:
    """The response side of one request: a status is sent once, first;
    ``errors`` writes an error as the request's API does.

    Messages are queued: a whole answer is written by :meth:`finish`, a
    stream's by a task of its own as they come. ``started`` and ``ended``
    say what is queued; an error while the status waits to go out
    replaces it.
    """

    def __init__(
        self,
        send: Send,
        errors: ErrorShape = OPENAI_ERRORS,
        outbox: Outbox | None = None,
        abort: Callable[[], None] | None = None,
    ) -> None:
        self._send = send
        self.errors = errors
        self._failed: Callable[[APIError], bytes] = errors.event
        self.outbox = outbox or Outbox()
        self._abort = abort
        self.status = 0
        self.started = False
        self.ended = False
        self.closed: str | None = None  # why the connection was closed
        self.kept = 0  # bytes queued, not yet written
        self.streaming = False  # a task writes the queue as it fills
        self._queue: deque[Message] = deque()
        self._delivered = False  # the status went out
        self._gone = False  # its client is gone: nothing more is written
        self._run: anyio.CancelScope | None = None
        self._writing: anyio.CancelScope | None = None
        self._written: anyio.Event | None = None  # the writing task ended
        self._wake: anyio.Event | None = None
        self._since: float | None = None  # the write under way began (monotonic)
        self._opening: Opening | None = None  # a stream to come: expect_stream
        self._every: float | None = None  # seconds between its keep-alives

    # -- what a door writes -------------------------------------------------

    async def json(
        self, body: bytes, status: int = 200, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        await self.whole(body, _JSON_HEADERS, status, extra)

    async def whole(
        self,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        status: int = 200,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        length = (b"content-length", str(len(body)).encode())
        self._start(status, [*headers, length, *extra])
        await self.send(body, more=False)

    async def start_stream(
        self,
        first: bytes,
        *,
        failed: Callable[[APIError], bytes] | None = None,
        media_type: bytes | None = None,
    ) -> None:
        """Begin server-sent events (or another stream of ``media_type``)
        with ``first``; a failure later ends the stream with
        ``failed(error)`` (default: the API's error event)."""
        self._failed = failed or self.errors.event
        self._start(200, _stream_headers(media_type), stream=True)
        await self.send(first)

    def expect_stream(self, opening: Opening, every: float) -> None:
        """A stream will follow: begin it with ``opening`` at :meth:`begin`
        (else ``every`` seconds from now), and until :meth:`answering` send
        its keep-alive after each ``every`` seconds of silence. An error
        before it began is a status; after, the opening's ``failed``."""
        self._opening, self._every = opening, every
        self._spawn_writer()

    async def begin(self) -> None:
        """Begin the stream :meth:`expect_stream` announced, unless it began."""
        opening = self._opening
        if opening is not None and not self.started and self.closed is None:
            failed, media_type = opening.failed, opening.media_type
            await self.start_stream(opening.head, failed=failed, media_type=media_type)

    def answering(self) -> None:
        """The answer's pieces flow: no more keep-alives."""
        self._every = None

    async def start_file_stream(self, media_type: bytes, first: bytes) -> None:
        """Begin an answer of another type than JSON, sent as it is made; a
        failure later ends it where it is (an error event would be read as
        the file's bytes)."""
        self._failed = _nothing
        self._start(200, _stream_headers(media_type), stream=True)
        await self.send(first)

    async def send(self, body: bytes, *, more: bool = True) -> None:
        """Queue ``body``. A client that reads too slowly has its connection
        closed here, and the request's run cancelled."""
        if self.closed is not None or self._gone or self.ended:
            return
        self.ended = not more
        self._queue.append(
            {"type": "http.response.body", "body": body, "more_body": more}
        )
        self._keep(len(body))
        if self.streaming:
            self._check()
            self._wake_writer()

    async def end(self) -> None:
        if self.started and not self.ended:
            await self.send(b"", more=False)

    async def error(self, error: APIError) -> None:
        if self.closed is not None or self.ended:
            return
        if error.status >= 500 and error is not self.outbox.ending:  # said once
            logger.warning("answering %d: %s", error.status, error.message)
        if not self.started or (not self._delivered and self._since is not None):
            # Its status waits to go out (the client reads nothing), or a
            # stream was announced: the error's status goes instead.
            self._stop_writing()
            self._drop()
            self.started = self.ended = self.streaming = False
        if not self.started:
            extra = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
            await self.json(self.errors.body(error), error.status, extra)
        elif not self.ended:
            await self.send(self._failed(error), more=False)

    # -- what the door's skeleton does --------------------------------------

    def running(self, scope: anyio.CancelScope) -> None:
        """``scope`` runs the request: it is cancelled when the answer must
        end early (its client reads too slowly, a shutdown)."""
        self._run = scope
        if self.outbox.ending is not None:
            scope.cancel()

    @property
    def ending(self) -> APIError | None:
        """The shutdown's error, once one ended the answer early."""
        return self.outbox.ending

    def interrupt(self) -> None:
        if self._run is not None:
            self._run.cancel()

    async def finish(self) -> None:
        """Write what is queued. A client that reads nothing for the write
        timeout (or past a shutdown's last write) has its connection closed."""
        try:
            if self.closed is None and self._writing is not None and self.ended:
                await self._wait_written()
            elif self.closed is None and self._writing is None and self._queue:
                await self._write_queued()
        finally:  # a stream that never ended (its client left) is left so
            self._stop_writing()

    def close(self, why: str) -> None:
        """Close the connection (``why`` it was, for the log): drop what is
        unwritten, stop writing, cancel the request's run."""
        if self.closed is not None:
            return
        self.closed = why
        self._stop_writing()
        self._drop()
        if self._run is not None:
            self._run.cancel()
        if self._abort is not None:
            self._abort()

    # -- inside -------------------------------------------------------------

    def _start(
        self, status: int, headers: list[tuple[bytes, bytes]], *, stream: bool = False
    ) -> None:
        self.status = status
        self.started = True
        self._queue.append(
            {"type": "http.response.start", "status": status, "headers": headers}
        )
        if not stream:
            self._stop_writing()  # an announced stream that never began
        elif self.closed is None:
            self.streaming = True
            if self._writing is None:
                self._spawn_writer()

    def _spawn_writer(self) -> None:
        self._writing = anyio.CancelScope()
        self._written = written = anyio.Event()
        spawn(self._write_all, self._writing, written)

    def _wake_writer(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _keep(self, size: int) -> None:
        self.kept += size
        self.outbox.kept += size

    def _drop(self) -> None:
        self.outbox.kept -= self.kept
        self.kept = 0
        self._queue.clear()

    def _check(self) -> None:
        outbox = self.outbox
        if self.kept > outbox.answer_bytes:
            self.close(
                f"its client left {self.kept} bytes unread, more than "
                f"--write-buffer-bytes ({outbox.answer_bytes})"
            )
        elif outbox.kept > outbox.total_bytes:
            outbox._over()
        elif self._since is not None:
            idle = time.monotonic() - self._since
            if idle > outbox.write_timeout:
                self.close(_read_nothing(outbox.write_timeout))

    def _stop_writing(self) -> None:
        if self._writing is not None:
            self._writing.cancel()
            self._writing = None

    async def _write_all(self, scope: anyio.CancelScope, written: anyio.Event) -> None:
        """Write the queue as it fills, until the last message (the task of
        a stream)."""
        with scope:
            try:
                while True:
                    while self._queue:
                        await self._write_first()
                    if self.ended:
                        return
                    came = await self._idle(self._every)
                    if not self.started:  # announced: the door began it, or now
                        await self.begin()
                    elif not came and self._opening and self._every is not None:
                        await self.send(self._opening.keep_alive)
            except OSError:  # the client is gone: its watcher ends the request
                self._gone = True
                self._drop()
            except Exception:
                logger.exception("writing an answer failed")
                self._gone = True
                self._drop()
            finally:
                self._since = None
                written.set()

    async def _idle(self, every: float | None) -> bool:
        """Wait for more to write, ``every`` seconds at most; whether it came."""
        self._wake = wake = anyio.Event()
        if every is None:
            await wake.wait()
        else:
            with anyio.move_on_after(every):
                await wake.wait()
        self._wake = None
        return wake.is_set()

    async def _write_first(self) -> None:
        message = self._queue[0]
        self._since = time.monotonic()
        await self._send(message)
        self._since = None
        self._queue.popleft()
        if message["type"] == "http.response.start":
            self._delivered = True
        else:
            size = len(message["body"])
            self.kept -= size
            self.outbox.kept -= size

    async def _wait_written(self) -> None:
        """Wait for the stream's task to write its end; close the connection
        when it makes no progress for the write timeout."""
        outbox, written = self.outbox, self._written
        assert written is not None, "a stream's task was started with it"
        while not written.is_set() and self.closed is None:
            since = self._since
            now = time.monotonic()
            due = min(outbox.last_write, (since or now) + outbox.write_timeout)
            with anyio.move_on_after(due - now):
                await written.wait()
            stuck = since is not None and self._since == since
            late = time.monotonic() >= outbox.last_write
            if not written.is_set() and (stuck or late):
                self._closed_late()

    async def _write_queued(self) -> None:
        outbox, timeout = self.outbox, self.outbox.write_timeout
        try:
            with anyio.CancelScope() as scope:
                while self._queue:
                    left = min(outbox.last_write - time.monotonic(), timeout)
                    scope.deadline = anyio.current_time() + left
                    await self._write_first()
        except OSError:  # the client is gone
            self._drop()
            return
        if scope.cancelled_caught:
            self._closed_late()

    def _closed_late(self) -> None:
        if time.monotonic() >= self.outbox.last_write:
            self.close("the server stopped before its client read its answer")
        else:
            self.close(_read_nothing(self.outbox.write_timeout))


def _stream_headers(media_type: bytes | None) -> list[tuple[bytes, bytes]]:
    if media_type is None:
        return _SSE_HEADERS
    return [(b"content-type", media_type), *_SSE_HEADERS[1:]]


def spawn(fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Run ``fn(*args)`` as a task that outlives its caller: a bare one on
    asyncio (a task group per answer costs the loop more)."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn, *args)
        return
    task = asyncio.get_running_loop().create_task(fn(*args))
    _writers.add(task)
    task.add_done_callback(_writers.discard)


def _read_nothing(timeout: float) -> str:
    return f"its client read nothing for {timeout:g} s (--write-timeout)"


def _nothing(error: APIError) -> bytes:
    return b""
