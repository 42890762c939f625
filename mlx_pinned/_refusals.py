"""The middleware's default answers to mlx-pinned's errors, in plain text.

Pure ASGI; called on the event loop, nothing here waits but the sends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._exceptions import (
    MLXPinnedError,
    MLXThreadBusyError,
    MLXThreadDeadlockError,
    StreamAffinityError,
)

__all__ = ["PlainText", "Refusal", "plain_refusal", "public_message"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
#: Makes the response to one of mlx-pinned's errors: an ASGI app to call.
Refusal = Callable[[MLXPinnedError], ASGIApp]

#: What a client reads for an error whose details are for the operator only.
INTERNAL_ERROR = "The server had an error while processing your request."


def plain_refusal(error: MLXPinnedError, *, retry_after: int) -> ASGIApp:
    """The default refusal: a plain-text 503 (``Retry-After: retry_after``
    when busy), a 500 for an error that is a bug (its details are logged)."""
    status = 500 if isinstance(error, _BUGS) else 503
    retry = isinstance(error, MLXThreadBusyError)
    headers = {"retry-after": str(retry_after)} if retry else {}
    return PlainText(status, public_message(error), headers)


class PlainText:
    """An ASGI app that answers one HTTP response in plain text."""

    def __init__(self, status: int, text: str, headers: dict[str, str]) -> None:
        self.status = status
        self.body = text.encode()
        self.headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(self.body)).encode()),
            *((name.encode(), value.encode()) for name, value in headers.items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status}
        await send({**start, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


# The errors that are bugs of the app or of mlx-pinned: a 500, details logged.
_BUGS = (StreamAffinityError, MLXThreadDeadlockError)


def public_message(error: MLXPinnedError) -> str:
    """What a client may read of ``error``: its message, unless it names jobs
    and threads (a bug's details are for the log)."""
    if isinstance(error, StreamAffinityError):
        return (
            f"{INTERNAL_ERROR[:-1]}: an MLX array was used on a thread that does "
            "not own it (details are in the server's log)."
        )
    if isinstance(error, _BUGS):
        return INTERNAL_ERROR
    return str(error)
