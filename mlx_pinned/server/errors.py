"""Errors answered in OpenAI's shape, and the one map that makes them.

A plain shared module (no Starlette, no pydantic, no MLX): the engine raises
:class:`APIError` subclasses for a request it refuses (a prompt too long),
the HTTP side raises and answers them, and :func:`api_error` turns every
other known condition (the MLX thread busy, closed or broken, a stream
affinity error, the model not loaded, a deadline) into one, so the same
condition has the same status and code on every route. :func:`refusal` is
the same map as the ASGI response
:class:`~mlx_pinned.middleware.MLXThreadMiddleware` sends for the thread's
errors. Any thread; nothing here waits but an answer's sends.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from mlx_pinned import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
    ShuttingDownError,
    StreamAffinityError,
)

__all__ = [
    "APIError",
    "ErrorAnswer",
    "api_error",
    "error_body",
    "internal_error",
    "model_not_loaded",
    "refusal",
    "server_busy",
    "shutting_down",
    "thread_unavailable",
    "timed_out",
]

#: The message of every 500: what went wrong is logged, never sent.
INTERNAL_ERROR = "The server had an error while processing your request."

Message = MutableMapping[str, Any]


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


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status.

    Args:
        status: The HTTP status code.
        message: One sentence that says what is wrong and what to do.
        param: The request parameter at fault, e.g. ``messages[0].content``.
        code: A short machine-readable code, e.g. ``model_not_found``.
        type: OpenAI's error type; derived from ``status`` when None.
        headers: Extra response headers (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body, ``{"error": {...}}``."""
        return error_body(
            self.message, type=self.type, param=self.param, code=self.code
        )


def api_error(exc: BaseException, *, retry_after: int) -> APIError | None:
    """The answer for a known condition: ``exc`` itself if it is an
    :class:`APIError`, the MLX thread's errors by the table below
    (``Retry-After: retry_after`` when busy); None for anything else.

    ``ShuttingDownError`` (a request in the shut-down): 503
    ``shutting_down``. ``MLXThreadBusyError``: 503 ``server_busy``, with
    ``Retry-After``. ``MLXThreadClosedError`` and ``MLXThreadBrokenError``:
    503 ``mlx_thread_unavailable``. ``StreamAffinityError``: 500
    ``stream_affinity_error`` whose message names no job or thread (log the
    error for those). ``MLXThreadDeadlockError`` (the app waited on the MLX
    thread for its own work): 500 ``internal_error``, the generic message.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ShuttingDownError):
        return shutting_down()
    if isinstance(exc, MLXThreadBusyError):
        headers = {"Retry-After": str(retry_after)}
        return APIError(503, str(exc), code="server_busy", headers=headers)
    if isinstance(exc, (MLXThreadClosedError, MLXThreadBrokenError)):
        return APIError(503, str(exc), code="mlx_thread_unavailable")
    if isinstance(exc, StreamAffinityError):
        return APIError(
            500,
            f"{INTERNAL_ERROR[:-1]}: an MLX array was used on a thread that does "
            "not own it (details are in the server's log).",
            code="stream_affinity_error",
        )
    if isinstance(exc, MLXThreadDeadlockError):
        return APIError(500, INTERNAL_ERROR, code="internal_error")
    return None


def refusal(exc: BaseException, *, retry_after: int) -> ErrorAnswer:
    """The middleware's answer to one of the MLX thread's errors, in OpenAI's
    shape (give it ``functools.partial(refusal, retry_after=...)``)."""
    return ErrorAnswer(api_error(exc, retry_after=retry_after) or internal_error())


class ErrorAnswer:
    """A pure ASGI app that answers one :class:`APIError` as JSON."""

    def __init__(self, error: APIError) -> None:
        self.status = error.status
        self.body = json.dumps(error.body()).encode()
        self.headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in error.headers.items()),
        ]

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        start = {"type": "http.response.start", "status": self.status}
        await send({**start, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def internal_error() -> APIError:
    """The 500 for an unexpected error: the details go to the log only."""
    return APIError(500, INTERNAL_ERROR)


def model_not_loaded() -> APIError:
    """The 503 while the model is still loading (or failed to)."""
    return APIError(
        503, "The model is not loaded yet; retry shortly.", code="model_not_loaded"
    )


def shutting_down() -> APIError:
    """The 503 of a server that is stopping: send new requests elsewhere."""
    return APIError(503, "The server is shutting down.", code="shutting_down")


def thread_unavailable() -> APIError:
    """The 503 once the MLX thread has stopped: nothing will ever run."""
    return APIError(
        503,
        "The MLX thread is not running, so no request can be served: restart "
        "the server.",
        code="mlx_thread_unavailable",
    )


def server_busy(waiting: int, *, retry_after: int) -> APIError:
    """The 503 of a full waiting room, with ``Retry-After``."""
    return APIError(
        503,
        f"The server is busy: {waiting} requests are already waiting for the "
        "model; retry shortly.",
        code="server_busy",
        headers={"Retry-After": str(retry_after)},
    )


def timed_out(timeout: float | None) -> APIError:
    """The 504 of a request past its deadline."""
    return APIError(
        504,
        f"The request did not finish within this server's limit of {timeout:g} s "
        "(waiting for the model plus generating): retry later, or ask for fewer "
        "tokens.",
        code="timeout",
    )
