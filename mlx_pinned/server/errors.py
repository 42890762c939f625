"""Errors answered in OpenAI's shape, and the one map that makes them.

A plain shared module (no Starlette, no pydantic, no MLX): the engine raises
:class:`APIError` subclasses for a request it refuses (a prompt too long),
the HTTP side raises and answers them, and :func:`api_error` turns every
other known condition (the MLX thread busy, closed or broken, a stream
affinity error, the model not loaded, a deadline) into one, so the same
condition has the same status and code on every route. The MLX thread's
errors are mapped by :func:`mlx_pinned._http_errors.http_answer`, the table
:class:`~mlx_pinned.middleware.MLXThreadMiddleware` answers with too.
"""

from __future__ import annotations

from typing import Any

from mlx_pinned._http_errors import (
    INTERNAL_ERROR,
    SHUTTING_DOWN,
    error_body,
    error_type,
    http_answer,
)

__all__ = [
    "APIError",
    "api_error",
    "error_body",
    "internal_error",
    "model_not_loaded",
    "server_busy",
    "shutting_down",
    "thread_unavailable",
    "timed_out",
]


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
    :class:`APIError`, the MLX thread's errors through the shared table
    (``Retry-After: retry_after`` when busy); None for anything else."""
    if isinstance(exc, APIError):
        return exc
    answer = http_answer(exc)
    if answer is None:
        return None
    headers = {"Retry-After": str(retry_after)} if answer.retry else None
    return APIError(answer.status, answer.message, code=answer.code, headers=headers)


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
    answer = SHUTTING_DOWN
    return APIError(answer.status, answer.message, code=answer.code)


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
