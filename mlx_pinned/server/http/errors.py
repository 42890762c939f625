"""The error edge: what a refusal is, each API's table, and OpenAI's shape.

Event loop only. Below the edge, code raises the domain failures of
:mod:`..failures` and the MLX thread's own errors, neither with an HTTP
status; :func:`api_error` turns each into an :class:`APIError` with no wire
shape, and the route it happens on picks the :class:`ErrorShape` that
writes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from mlx_pinned import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
    ShuttingDownError,
    StreamAffinityError,
)

from ..failures import (
    AudioRefusedError,
    MediaRefusedError,
    PromptError,
    RequestError,
    UnavailableError,
    VideoRefusedError,
)

__all__ = [
    "OPENAI_ERRORS",
    "APIError",
    "ErrorShape",
    "OpenAIErrors",
    "api_error",
    "completion_stream_failed",
    "internal_error",
    "shutting_down",
    "thread_unavailable",
    "timed_out",
]

#: The message of every 500: what went wrong is logged, never sent.
INTERNAL_ERROR = "The server had an error while processing your request."


class APIError(Exception):
    """A refusal with its HTTP status, written by each API's
    :class:`ErrorShape`; ``message`` is one sentence that says what is
    wrong and what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


# Each kind of media refusal: what the message calls it, and how the places
# of its parts end (an image's place is any other).
_MEDIA: dict[type[MediaRefusedError], tuple[str, str]] = {
    VideoRefusedError: ("video", ".video_url"),
    AudioRefusedError: ("audio", ".input_audio"),
}


def _media_suffix(place: str) -> str:
    return next((s for _, s in _MEDIA.values() if place.endswith(s)), "")


def api_error(
    exc: BaseException,
    *,
    retry_after: int,
    places: Sequence[str] = (),
    prompt: str = "messages",
) -> APIError | None:
    """The answer for a known condition; None for anything else (a bug: the
    caller logs it and answers :func:`internal_error`). The MLX thread's bugs
    are 500s whose message names no job or thread: log those too.

    Args:
        retry_after: Seconds in the ``Retry-After`` of a busy MLX thread.
        places: Where each image, video and audio file of the request is,
            in prompt order per kind (``messages[1].content[0].image_url``),
            to name a refused one.
        prompt: The request's part that a refused prompt or input is named
            by (``messages``, ``prompt``, ``input``...).
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, MediaRefusedError):
        what, suffix = _MEDIA.get(type(exc), ("image", ""))
        kind = [p for p in places if _media_suffix(p) == suffix]
        param = kind[exc.index] if exc.index < len(kind) else prompt
        message = f"Invalid {what} at '{param}': {exc.message}"
        return APIError(400, message, param=param, code=exc.code)
    if isinstance(exc, PromptError):
        return APIError(400, exc.message, param=prompt, code=exc.code)
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, param=exc.field, code=exc.code)
    if isinstance(exc, UnavailableError):
        wait = exc.retry_after
        headers = {} if wait is None else {"Retry-After": str(wait)}
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


class ErrorShape(Protocol):
    """One API's errors: its table, and how it writes an answer."""

    def answer(
        self,
        exc: BaseException,
        *,
        retry_after: int,
        places: Sequence[str] = (),
        prompt: str = "messages",
    ) -> APIError | None:
        """The answer to ``exc``; None for a bug (see :func:`api_error`)."""
        ...

    def body(self, error: APIError) -> bytes: ...

    def event(self, error: APIError) -> bytes:
        """The server-sent event that ends a stream already begun."""
        ...


class OpenAIErrors:
    """OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``,
    and a ``data:`` event of it; the table is :func:`api_error`. Also the
    shape of the routes of no API (the probes, unknown URLs)."""

    def answer(
        self,
        exc: BaseException,
        *,
        retry_after: int,
        places: Sequence[str] = (),
        prompt: str = "messages",
    ) -> APIError | None:
        return api_error(exc, retry_after=retry_after, places=places, prompt=prompt)

    def body(self, error: APIError) -> bytes:
        status = error.status
        kind = "rate_limit_error" if status == 429 else "invalid_request_error"
        inner = {
            "message": error.message,
            "type": "server_error" if status >= 500 else kind,
            "param": error.param,
            "code": error.code,
        }
        return json.dumps({"error": inner}).encode()

    def event(self, error: APIError) -> bytes:
        return b"data: " + self.body(error) + b"\n\n"


OPENAI_ERRORS = OpenAIErrors()


def completion_stream_failed(error: APIError) -> bytes:
    """How a chat or text completion stream ends on a failure: the error
    chunk, then ``[DONE]``, as on a stream's own end."""
    return OPENAI_ERRORS.event(error) + b"data: [DONE]\n\n"


def internal_error() -> APIError:
    return APIError(500, INTERNAL_ERROR)


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", code="shutting_down")


def thread_unavailable() -> APIError:
    return APIError(
        503,
        "The MLX thread is not running, so no request can be served: restart "
        "the server.",
        code="mlx_thread_unavailable",
    )


def timed_out(timeout: float | None) -> APIError:
    return APIError(
        504,
        f"The request did not finish within this server's limit of {timeout:g} s "
        "(waiting for the model plus generating): retry later, or ask for fewer "
        "tokens.",
        code="timeout",
    )
