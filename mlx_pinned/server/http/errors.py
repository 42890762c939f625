"""The OpenAI-shaped answers and the one table that makes them.

Event loop only (the middleware's refusal is sent from it too). Below the
edge, code raises what went wrong: the domain failures of :mod:`..failures`
(a prompt too long, an image refused, the model not loaded, a full waiting
room) and the MLX thread's own errors, neither with an HTTP status. Here,
and only here, :func:`api_error` turns each into an :class:`APIError` with
its status, its code and the part of the request at fault, so the same
condition has the same answer on every route; the HTTP side also raises
:class:`APIError` itself for what only it checks (the body, the fields).
:func:`refusal` is the same table as the ASGI response
:class:`~mlx_pinned.middleware.MLXThreadMiddleware` sends for the thread's
errors. Another API (another error shape) has a table of its own over the
same failures.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from mlx_pinned import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
    ShuttingDownError,
    StreamAffinityError,
)

from ..failures import (
    ImageRefusedError,
    ImagesUnsupportedError,
    PromptTooLongError,
    RequestError,
    UnavailableError,
    VideoRefusedError,
)

__all__ = [
    "APIError",
    "ErrorAnswer",
    "api_error",
    "error_body",
    "internal_error",
    "model_not_loaded",
    "refusal",
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


def api_error(
    exc: BaseException, *, retry_after: int, images: Sequence[str] = ()
) -> APIError | None:
    """The answer for a known condition; None for anything else (a bug: the
    caller logs it and answers :func:`internal_error`).

    Args:
        exc: What was raised.
        retry_after: Seconds in the ``Retry-After`` of a 503 whose condition
            names none.
        images: Where each image and video of the request is, in prompt
            order per kind (``messages[1].content[0].image_url``,
            ``messages[1].content[1].video_url``), to name a refused one.

    The table: an :class:`APIError` is itself. A
    :class:`~..failures.RequestError` is a 400 with its code (the part at
    fault: ``messages`` for the prompt, the image's or the video's part for
    one of those). An
    :class:`~..failures.UnavailableError` is a 503 with ``Retry-After``.
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
    if isinstance(exc, ImageRefusedError | VideoRefusedError):
        video = isinstance(exc, VideoRefusedError)
        kind = [p for p in images if p.endswith(".video_url") == video]
        param = kind[exc.index] if exc.index < len(kind) else "messages"
        what = "video" if video else "image"
        message = f"Invalid {what} at '{param}': {exc.message}"
        return APIError(400, message, param=param, code=exc.code)
    if isinstance(exc, ImagesUnsupportedError | PromptTooLongError):
        return APIError(400, exc.message, param="messages", code=exc.code)
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, code=exc.code)
    if isinstance(exc, UnavailableError):
        wait = exc.retry_after if exc.retry_after is not None else retry_after
        headers = {"Retry-After": str(wait)}
        return APIError(503, exc.message, code=exc.code, headers=headers)
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


def timed_out(timeout: float | None) -> APIError:
    """The 504 of a request past its deadline."""
    return APIError(
        504,
        f"The request did not finish within this server's limit of {timeout:g} s "
        "(waiting for the model plus generating): retry later, or ask for fewer "
        "tokens.",
        code="timeout",
    )
