"""The OpenAI-shaped routes' error table: a failure to its answer.

Event loop only. Below the edge, code raises what went wrong
(:mod:`..failures`, the MLX thread's own errors); here, and only here, each
becomes an :class:`~..errors.APIError` with its status, its code and the part
of the request at fault. Another API (another error shape) has a table of its
own over the same failures.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import APIError
from ..errors import api_error as thread_error
from ..failures import (
    ImageRefusedError,
    ImagesUnsupportedError,
    PromptTooLongError,
    RequestError,
    UnavailableError,
)

__all__ = ["api_error"]


def api_error(
    exc: BaseException, *, retry_after: int, images: Sequence[str] = ()
) -> APIError | None:
    """The answer for a known failure; None for anything else (a bug: a 500).

    Args:
        exc: What was raised.
        retry_after: Seconds in the ``Retry-After`` of a 503 whose failure
            names none.
        images: Where each image of the request is, in prompt order
            (``messages[1].content[0].image_url``), to name a refused one.
    """
    if isinstance(exc, ImageRefusedError):
        param = images[exc.index] if exc.index < len(images) else "messages"
        message = f"Invalid image at '{param}': {exc.message}"
        return APIError(400, message, param=param, code=exc.code)
    if isinstance(exc, ImagesUnsupportedError | PromptTooLongError):
        return APIError(400, exc.message, param="messages", code=exc.code)
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, code=exc.code)
    if isinstance(exc, UnavailableError):
        wait = exc.retry_after if exc.retry_after is not None else retry_after
        headers = {"Retry-After": str(wait)}
        return APIError(503, exc.message, code=exc.code, headers=headers)
    return thread_error(exc, retry_after=retry_after)
