"""The one map from mlx-pinned's errors to HTTP answers in OpenAI's shape.

Used by :class:`~mlx_pinned.middleware.MLXThreadMiddleware` and by the
reference server alike, so a condition has the same status and code on every
route. Pure Python: any thread, nothing here waits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ._exceptions import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
    StreamAffinityError,
)

__all__ = [
    "INTERNAL_ERROR",
    "SHUTTING_DOWN",
    "STARTUP_FAILED",
    "HTTPAnswer",
    "error_body",
    "http_answer",
]

#: The message of every 500: what went wrong is logged, never sent.
INTERNAL_ERROR = "The server had an error while processing your request."


@dataclass(frozen=True, slots=True)
class HTTPAnswer:
    """The status, code and message that answer one condition.

    Attributes:
        status: The HTTP status.
        code: OpenAI's machine-readable ``error.code``.
        message: One sentence for the client.
        retry: Whether the answer carries ``Retry-After`` (the server is busy,
            not broken: the same request may succeed later).
    """

    status: int
    code: str
    message: str
    retry: bool = False

    @property
    def type(self) -> str:
        """OpenAI's ``error.type`` for the status."""
        return error_type(self.status)

    def body(self) -> bytes:
        """The JSON body, ``{"error": {...}}``."""
        data = error_body(self.message, type=self.type, code=self.code)
        return json.dumps(data).encode()


#: A request that arrives while the server shuts down.
SHUTTING_DOWN = HTTPAnswer(503, "shutting_down", "The server is shutting down.")
#: A request that arrives after the server's start-up failed.
STARTUP_FAILED = HTTPAnswer(
    503, "mlx_thread_unavailable", "The server failed to start: see its log."
)


def http_answer(exc: BaseException) -> HTTPAnswer | None:
    """The answer for one of mlx-pinned's errors; None for any other.

    ``MLXThreadBusyError``: 503 ``server_busy``, with ``Retry-After``.
    ``MLXThreadClosedError`` and ``MLXThreadBrokenError``: 503
    ``mlx_thread_unavailable``. ``StreamAffinityError``: 500
    ``stream_affinity_error`` whose message names no job or thread (log
    the error for those). ``MLXThreadDeadlockError`` (the app waited on the
    MLX thread for its own work): 500 ``internal_error``, the generic
    message; a bug of the app, whose details belong in the log.
    """
    if isinstance(exc, MLXThreadBusyError):
        return HTTPAnswer(503, "server_busy", str(exc), retry=True)
    if isinstance(exc, (MLXThreadClosedError, MLXThreadBrokenError)):
        return HTTPAnswer(503, "mlx_thread_unavailable", str(exc))
    if isinstance(exc, StreamAffinityError):
        return HTTPAnswer(
            500,
            "stream_affinity_error",
            "The server had an error while processing your request: an MLX "
            "array was used on a thread that does not own it (details are in "
            "the server's log).",
        )
    if isinstance(exc, MLXThreadDeadlockError):
        return HTTPAnswer(500, "internal_error", INTERNAL_ERROR)
    return None


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, object]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
