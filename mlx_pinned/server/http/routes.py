"""The small routes and the app's error handlers: ``/v1/models``, unknown
URLs, unexpected errors, and the API key check.

Event loop only. Every answer is in OpenAI's error shape, from
:mod:`..errors`.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ..formats import model_formats
from .errors import APIError, internal_error
from .playground import ASSETS_PREFIX, PAGE

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import ASGIApp, Receive, Scope, Send

    from .models import ServedModel, ServedModels

__all__ = [
    "APIKeyMiddleware",
    "error_response",
    "http_error",
    "model",
    "model_card",
    "models",
    "server_error",
]

logger = logging.getLogger("mlx_pinned.server")

#: The probe routes, open without the API key.
PROBES = frozenset({"/health", "/livez"})


def error_response(error: APIError) -> JSONResponse:
    """``error`` as a JSON response with its status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def model_card(served: ServedModel, request: Request) -> dict[str, Any]:
    """The ``/v1/models`` entry of a served model; ``created``: when it was
    loaded (now, while it loads), or for one loaded on first use, when the
    server was made (its loads come and go)."""
    if not served.slot.pinned:
        created = int(served.slot.created)
    else:
        loaded = served.engine()
        created = int(getattr(loaded, "loaded_at", None) or time.time())
    # Its output formats, by its settings and its template (None until loaded).
    config, engine = request.app.state.config, served.engine()
    own = config.for_model(config.names.index(served.name))
    formats = (
        None
        if engine is None
        else model_formats(
            engine.chat_template,
            tool_call_parser=own.tool_call_parser,
            reasoning_parser=own.reasoning_parser,
        ).names()
    )
    return {
        "id": served.name,
        "object": "model",
        "created": created,
        "owned_by": "mlx-pinned",
        "formats": formats,
    }


async def models(served: ServedModels, request: Request) -> Response:
    """``GET /v1/models``: every served model, in the order given."""
    data = [model_card(item, request) for item in served]
    return JSONResponse({"object": "list", "data": data})


async def model(served: ServedModels, request: Request) -> Response:
    """``GET /v1/models/{model_id}``; 404 naming the served ones for any other."""
    try:
        found = served.get(request.path_params["model_id"])
    except APIError as error:
        return error_response(error)
    return JSONResponse(model_card(found, request))


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 in OpenAI's shape; a 405 keeps ``Allow``."""
    assert isinstance(exc, HTTPException)
    message = {404: "Unknown URL: see /v1/models and /v1/chat/completions."}.get(
        exc.status_code, str(exc.detail)
    )
    if exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    error = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
    return error_response(error)


async def server_error(request: Request, exc: Exception) -> Response:
    """An unexpected error: a 500 that names nothing; the log has it all."""
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(internal_error())


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every HTTP route except the probes
    (``/health`` and ``/livez``): balancers and process managers send none;
    and except the playground's page and assets, which hold no data: the
    page asks for the key and sends it on its API calls.

    The key is compared in constant time.
    """

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.strip().partition(b" ")
        # The scheme is case-insensitive, and spaces may follow it (RFC 9110).
        key = key.strip()
        if scheme.lower() == b"bearer" and hmac.compare_digest(key, self._expected):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
        await error_response(error)(scope, receive, send)


def _is_open(path: str) -> bool:
    """Whether ``path`` needs no API key: a probe, or the playground's page
    or one of its assets."""
    return path in PROBES or path == PAGE or path.startswith(ASSETS_PREFIX)
