"""The small routes and the error edge: ``/v1/models`` and its loads and
unloads by API, the API key check, and :class:`ErrorEdge`, which answers
every refusal outside a door in the shape of the route it happens on.

Event loop only.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import OPENAI_ERRORS, APIError, ErrorShape, internal_error
from .playground import ASSETS_PREFIX, PAGE
from .served_models import SlotState, expires_at

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.routing import BaseRoute
    from starlette.types import ASGIApp, Receive, Scope, Send

    from .residency import Residency
    from .served_models import ServedModel, ServedModels

__all__ = [
    "APIKeyMiddleware",
    "ErrorEdge",
    "load_model",
    "model",
    "model_card",
    "models",
    "unload_model",
]

logger = logging.getLogger("mlx_pinned.server")

#: The probe routes, open without the API key.
PROBES = frozenset({"/health", "/livez"})


class ErrorEdge:
    """Which API answers a refusal on a path: the one its route in
    ``routes`` declares (a door's ``errors``), else OpenAI's. A busy MLX
    thread's refusal says to wait ``retry_after`` s."""

    def __init__(self, routes: Sequence[BaseRoute], *, retry_after: int) -> None:
        self.retry_after = retry_after
        self._shapes = [
            (route.path_regex, shape)
            for route in routes
            if isinstance(route, Route)
            and (shape := getattr(route.endpoint, "errors", None)) is not None
        ]

    def shape(self, path: str) -> ErrorShape:
        found = (shape for regex, shape in self._shapes if regex.match(path))
        return next(found, OPENAI_ERRORS)

    def response(self, path: str, exc: BaseException) -> Response:
        """The answer to ``exc`` on ``path``; a bug is a 500 that names
        nothing."""
        shape = self.shape(path)
        error = shape.answer(exc, retry_after=self.retry_after) or internal_error()
        body = shape.body(error)
        return Response(
            body, error.status, error.headers, media_type="application/json"
        )

    def refusal(self, exc: BaseException) -> ASGIApp:

        async def answer(scope: Scope, receive: Receive, send: Send) -> None:
            await self.response(scope["path"], exc)(scope, receive, send)

        return answer

    async def refused(self, request: Request, exc: Exception) -> Response:
        """The handler of a refusal a route raised (an :class:`APIError`, a
        failure), and of Starlette's 404 and 405 (a 405 keeps ``Allow``)."""
        if isinstance(exc, HTTPException):
            message = {
                404: "Unknown URL: see /v1/models and /v1/chat/completions.",
                405: f"Method {request.method} is not allowed for {request.url.path}.",
            }.get(exc.status_code, str(exc.detail))
            exc = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
        return self.response(request.url.path, exc)

    async def server_error(self, request: Request, exc: Exception) -> Response:
        """An unexpected error: a 500 that names nothing; the log has it all."""
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return self.response(request.url.path, internal_error())


def model_card(served: ServedModel, request: Request) -> dict[str, Any]:
    """The ``/v1/models`` entry of a served model; ``created``: when it was
    loaded (now, while it loads), or for one loaded on first use, when the
    server was made; where it is (``state``, ``weight_bytes`` while loaded,
    ``expires_at``: when it will be unloaded, Unix seconds, null for never);
    while it is loaded, what its engine's facts add."""
    slot = served.slot
    if not slot.at_start_up:
        created = int(slot.created)
    else:
        loaded = served.engine()
        created = int(getattr(loaded, "loaded_at", None) or time.time())
    expires = expires_at(slot)
    card: dict[str, Any] = {
        "id": served.name,
        "object": "model",
        "created": created,
        "owned_by": "mlx-pinned",
        "kind": served.kind,
        "state": slot.state.value,
        "pinned": slot.pinned,
        "weight_bytes": slot.weight_bytes if slot.state is SlotState.LOADED else None,
        "expires_at": None if expires is None else int(expires),
    }
    engine = served.engine()
    if engine is not None:
        card.update(engine.facts.card())
    return card


async def models(served: ServedModels, request: Request) -> Response:
    data = [model_card(item, request) for item in served]
    return JSONResponse({"object": "list", "data": data})


async def model(served: ServedModels, request: Request) -> Response:
    found = served.get(request.path_params["model_id"])
    return JSONResponse(model_card(found, request))


async def load_model(
    served: ServedModels, residency: Residency, request: Request
) -> Response:
    """``POST /v1/models/{id}/load``: its card once it is loaded (at once if
    it was); its idle timeout counts from then."""
    found = served.get(request.path_params["model_id"])
    async with residency.use(found):
        pass
    return JSONResponse(model_card(found, request))


async def unload_model(
    served: ServedModels, residency: Residency, request: Request
) -> Response:
    """``POST /v1/models/{id}/unload``: its card once the requests using it
    have ended and it is unloaded; the next request loads it again."""
    found = served.get(request.path_params["model_id"])
    await residency.unload(found, "unloaded by API")
    return JSONResponse(model_card(found, request))


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``)
    on every HTTP route but the probes (balancers send none) and the
    playground's page and assets (they hold no data; the page asks for the
    key). A wrong or missing key is a 401 in the route's shape.
    """

    def __init__(self, app: ASGIApp, *, api_key: str, errors: ErrorEdge) -> None:
        self.app = app
        self._expected = api_key.encode()
        self._errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").strip().partition(b" ")
        # The scheme is case-insensitive, and spaces may follow it (RFC 9110);
        # Anthropic's clients (Claude Code) send the key as x-api-key.
        given = [key.strip()] if scheme.lower() == b"bearer" else []
        given += [headers[b"x-api-key"].strip()] if b"x-api-key" in headers else []
        if any(hmac.compare_digest(sent, self._expected) for sent in given):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
            "or 'x-api-key: <key>'.",
            code="invalid_api_key",
        )
        await self._errors.response(scope["path"], error)(scope, receive, send)


def _is_open(path: str) -> bool:
    return path in PROBES or path == PAGE or path.startswith(ASSETS_PREFIX)
