"""Runs a retry takes over: a request that carries an ``Idempotency-Key``
has its answer recorded from its first message; when its client goes
away, its run goes on, and a retry of the same body with the same key gets
that answer from the start, then live, with nothing computed again.

Event loop only. The record is the ASGI messages as the first client's
writer sent them, so a retry's answer is the first one, byte for byte.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
from typing import TYPE_CHECKING

import anyio

from .errors import APIError

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Send

    from ..config import ServerConfig
    from .outbox import ResponseWriter

__all__ = ["HEADER", "Reader", "Run", "Takeovers", "Ticket"]

HEADER = "Idempotency-Key"
MAX_KEY = 255


class Reader(enum.Enum):
    """Who reads a run's answer as it is made."""

    FIRST = "its first client, still connected"
    NONE = "no one: its first client went away"
    RETRY = "a retry that took it over"


class Run:
    """One keyed run: its body's digest, who reads it, and every message of
    its answer so far; ``running`` until its first request's handling ends."""

    def __init__(self, digest: str, send: Send) -> None:
        self.digest = digest
        self.reader = Reader.FIRST
        self.running = True
        self.messages: list[Message] = []
        self._first = send
        self._wake = anyio.Event()

    async def record(self, message: Message) -> None:
        self.messages.append(message)
        self._wake.set()
        self._wake = anyio.Event()
        if self.reader is Reader.FIRST:
            with contextlib.suppress(OSError):  # it went: its watcher decides
                await self._first(message)

    async def replay(self, send: Send) -> None:
        """Send every message, those to come too, until the answer's last
        (or the run's end)."""
        sent = 0
        while True:
            wake = self._wake
            for message in self.messages[sent:]:
                sent += 1
                await send(message)
                if not message.get("more_body", True):
                    return
            if not self.running:
                return
            await wake.wait()

    def ended(self) -> None:
        self.running = False
        self._wake.set()


class Takeovers:
    """The keyed runs under way, by route and key; at most ``limit`` of
    them go on once their first client has gone."""

    def __init__(self, limit: float = math.inf) -> None:
        self.limit = limit
        self.runs: dict[tuple[str, str], Run] = {}

    @classmethod
    def of(cls, config: ServerConfig) -> Takeovers:
        """At most as many kept runs as the models have rows."""
        models = range(len(config.models))
        return cls(sum(config.for_model(i).max_num_seqs for i in models))

    def kept(self) -> int:
        """The runs whose first client has gone."""
        return sum(run.reader is not Reader.FIRST for run in self.runs.values())


class Ticket:
    """One keyed request at ``route``: the first of its key (it records its
    run), or a retry that takes a run over (it replays it)."""

    def __init__(self, takeovers: Takeovers, route: str, key: str, send: Send) -> None:
        self.takeovers = takeovers
        self.at = (route, key)
        self.key = key
        self._send = send
        self.run: Run | None = None  # the run it records
        self.taken: Run | None = None  # the run it took over

    async def send(self, message: Message) -> None:
        """Its writer's send: recorded once it runs under its key."""
        if self.run is None:
            await self._send(message)
        else:
            await self.run.record(message)

    def watch(self, receive: Receive) -> Receive:
        """``receive`` for its disconnect watcher: when its client goes, a
        run it records goes on (within the limit) and no disconnect comes."""

        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and self._orphaned():
                await anyio.sleep_forever()
            return message

        return watched

    def _orphaned(self) -> bool:
        run = self.run
        if run is None or run.reader is not Reader.FIRST:
            return False
        if self.takeovers.kept() >= self.takeovers.limit:
            return False
        run.reader = Reader.NONE
        return True

    async def answered(self, body: bytes, response: ResponseWriter) -> bool:
        """Register its run, or take over the run of its key and replay its
        answer to ``response``'s client (True).

        Raises:
            APIError: A bad key (400); its key's run is still read by a
                client (409), or was asked with another body (422).
        """
        if not self.key or len(self.key) > MAX_KEY:
            raise APIError(
                400,
                f"The {HEADER} header must be 1 to {MAX_KEY} characters long.",
                param=HEADER,
                code="invalid_idempotency_key",
            )
        digest = _digest(body)
        run = self.takeovers.runs.get(self.at)
        if run is None:
            self.run = self.takeovers.runs[self.at] = Run(digest, self._send)
            return False
        if run.digest != digest:
            raise APIError(
                422,
                f"This {HEADER} was sent with another request body: send the "
                "same body to retry, or use a new key.",
                param=HEADER,
                code="idempotency_key_reused",
            )
        if run.reader is not Reader.NONE:
            raise APIError(
                409,
                f"The request of this {HEADER} is still answered to a client: "
                "retry once that client has gone, or use a new key.",
                param=HEADER,
                code="idempotency_key_in_use",
            )
        run.reader, self.taken = Reader.RETRY, run

        async def send(message: Message) -> None:  # what its writer would say
            if message["type"] == "http.response.start":
                response.status, response.started = message["status"], True
            response.ended = not message.get("more_body", True)
            await self._send(message)

        with contextlib.suppress(OSError):  # its client went
            await run.replay(send)
        if not response.started:
            raise APIError(
                503,
                f"The request of this {HEADER} ended without an answer: retry "
                "with a new key.",
                code="idempotency_key_unanswered",
            )
        return True

    def close(self) -> None:
        """Its request's handling ended: drop a run no one reads any more."""
        runs = self.takeovers.runs
        if self.run is not None:
            self.run.ended()
            if self.run.reader is not Reader.RETRY:
                runs.pop(self.at, None)
        elif self.taken is not None:
            if self.taken.running:
                self.taken.reader = Reader.NONE
            else:
                runs.pop(self.at, None)


def _digest(body: bytes) -> str:
    """The hash of ``body`` as parsed (its bytes where it is not JSON)."""
    try:
        parsed = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return hashlib.sha256(body).hexdigest()
    return hashlib.sha256(parsed.encode()).hexdigest()
