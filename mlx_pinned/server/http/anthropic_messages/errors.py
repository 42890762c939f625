"""Anthropic's error shape, and this API's table over the domain failures.

Event loop (pure CPU). The body is ``{"type": "error", "error": {"type",
"message"}}``; a stream already begun ends with the same object as an
``event: error``. The table starts from the shared one
(:func:`..errors.api_error`: the same condition, the same message) and
gives each answer Anthropic's status and type (docs/anthropic.md lists
them): 529 ``overloaded_error`` for a full waiting room or a busy MLX
thread, Anthropic's "overloaded, retry", which its SDKs and Claude Code
retry, with ``Retry-After``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from mlx_pinned import MLXThreadBusyError

from ...failures import OverloadedError
from ..errors import APIError, api_error

__all__ = ["ANTHROPIC_ERRORS", "AnthropicErrors", "anthropic_error", "error_type"]

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for a status (``api_error`` for the rest
    of the 5xx, ``invalid_request_error`` for the rest of the 4xx)."""
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicErrors:
    """Anthropic's shape: ``{"type": "error", "error": {...}}``, and an
    ``event: error`` of it."""

    def answer(
        self, exc: BaseException, *, retry_after: int, images: Sequence[str] = ()
    ) -> APIError | None:
        """The answer for a known failure in this API's statuses; None for a
        bug (the base logs it and answers a 500)."""
        error = api_error(exc, retry_after=retry_after, images=images)
        if error is not None and isinstance(exc, OverloadedError | MLXThreadBusyError):
            return APIError(529, error.message, code=error.code, headers=error.headers)
        return error

    def body(self, error: APIError) -> bytes:
        inner = {"type": error_type(error.status), "message": error.message}
        return json.dumps({"type": "error", "error": inner}).encode()

    def event(self, error: APIError) -> bytes:
        return b"event: error\ndata: " + self.body(error) + b"\n\n"


ANTHROPIC_ERRORS = AnthropicErrors()
#: This API's table, for its endpoints.
anthropic_error = ANTHROPIC_ERRORS.answer
