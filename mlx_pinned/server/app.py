"""The OpenAI-compatible vision server: a Starlette app on one MLX thread.

Built only from mlx-pinned's public pieces (``MLXThread``,
``MLXThreadMiddleware``), Starlette and mlx-vlm. Where work runs:

- the event loop parses and validates requests and writes responses;
- an anyio worker thread decodes images (no MLX there);
- the MLX thread loads the model (a start-up job of the middleware) and runs
  each generation, prompt and image preprocessing included, as a stream
  (``MLXThread.iterate``).

Generations are admitted in arrival order by a :class:`BatchGate`: up to
``max_num_seqs`` decode together in one batch (:mod:`.batching`), each with
its own rope state, cache rows and sampler. With ``max_num_seqs=1`` they run
one at a time through the unbatched engine, since mlx-vlm's
Qwen-VL models keep request state on the model object, so two generations
interleaved token by token would silently corrupt each other. At most
``max_pending`` requests wait; past that the server answers 503 at once.

What the server refuses, and how each limit is set: docs/security.md.
"""

from __future__ import annotations

import functools
import gc
import hmac
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_pinned import MLXThread
from mlx_pinned.middleware import MLXThreadMiddleware

from . import engine
from ._batch_gate import BatchGate
from ._chat import ChatEndpoint, model_not_found
from ._http import LoopTurns
from ._metrics import MetricsMiddleware, ServerMetrics
from ._remote import RemoteImageFetcher
from .images import Fetcher, ImageLimits
from .schemas import APIError

__all__ = ["ServerConfig", "create_app"]

logger = logging.getLogger("mlx_pinned.server")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server; see :func:`create_app` for each one."""

    model: str
    served_model_name: str
    max_tokens_limit: int = 4096
    default_max_tokens: int = 512
    max_pending: int = 256
    max_num_seqs: int = 32
    max_body_bytes: int = 20 * 1024 * 1024
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    api_key: str | None = None
    allow_remote_images: bool = False
    remote_image_timeout: float = 10.0
    max_prompt_tokens: int | None = None
    request_timeout: float | None = 600.0


def create_app(
    model: str | Path,
    *,
    served_model_name: str | None = None,
    max_tokens_limit: int = 4096,
    default_max_tokens: int = 512,
    max_pending: int = 256,
    max_num_seqs: int = 32,
    max_body_bytes: int = 20 * 1024 * 1024,
    image_limits: ImageLimits | None = None,
    api_key: str | None = None,
    thread: MLXThread | None = None,
    drain_timeout: float = 30.0,
    allow_remote_images: bool = False,
    remote_image_timeout: float = 10.0,
    image_fetcher: Fetcher | None = None,
    max_prompt_tokens: int | None = None,
    request_timeout: float | None = 600.0,
    freeze_gc: bool = False,
) -> Starlette:
    """Create the server app for one model.

    The model is loaded on the MLX thread when the app's lifespan starts (run
    the app under uvicorn, or drive its lifespan in tests); a failed load fails
    the start-up with the reason. At shutdown in-flight requests get
    ``drain_timeout`` seconds to finish, then the thread is closed.

    Args:
        model: A local model folder or a Hugging Face hub id.
        served_model_name: The name clients send as ``model``; defaults to
            ``model`` as given. Any other name is a 404.
        max_tokens_limit: The largest ``max_tokens`` a request may ask for;
            more is a 400.
        default_max_tokens: ``max_tokens`` when a request sets none.
        max_pending: Requests that may wait for the model; past it, 503 with
            ``Retry-After``. Also the MLX thread's queue bound.
        max_num_seqs: Generations decoded together in one batch (continuous
            batching, :mod:`.batching`); the rest wait their turn. 1: one
            generation at a time, through the unbatched engine.
        max_body_bytes: Largest request body; more is a 413.
        image_limits: Limits on images per request, bytes and pixels.
        api_key: When set, every route but ``/health`` needs
            ``Authorization: Bearer <api_key>``; otherwise 401.
        thread: The MLX thread to run on; a new one when None. The app's
            lifespan starts and closes it.
        drain_timeout: Seconds in-flight requests get at shutdown.
        allow_remote_images: Fetch ``http(s)://`` image URLs (off: they are a
            400). Only public addresses are fetched (see ``_remote.py``), at
            most ``image_limits.max_bytes`` per image.
        remote_image_timeout: Seconds for fetching one remote image.
        image_fetcher: Fetches remote images instead of the default
            :class:`RemoteImageFetcher` (implies ``allow_remote_images``).
        max_prompt_tokens: Most prompt tokens, images included; None: the
            model's context length from its config. A longer prompt, or one
            that with ``max_tokens`` exceeds the context, is a 400.
        request_timeout: Seconds a request may take after its body is read
            (images, queue wait and generation); past it, 504 (or an error
            event) and the generation is closed. None: no limit.
        freeze_gc: After the model is loaded, collect garbage once and move
            every object left to the collector's permanent generation
            (:func:`gc.freeze`), so later full collections skip the libraries
            and the model: here they took 120 ms, during which nothing on the
            event loop or the MLX thread ran. Process-wide, so off by
            default; the CLI turns it on.

    Returns:
        A Starlette app.
    """
    if min(max_tokens_limit, max_pending, max_num_seqs, max_body_bytes) < 1:
        raise ValueError(
            "max_tokens_limit, max_pending, max_num_seqs and max_body_bytes"
            " must be >= 1"
        )
    if api_key == "":
        raise ValueError("api_key is empty: give a key, or None for no key")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, not {max_prompt_tokens}")
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0, not {request_timeout}")
    if not remote_image_timeout > 0:
        raise ValueError(
            f"remote_image_timeout must be > 0, not {remote_image_timeout}"
        )
    config = ServerConfig(
        model=str(model),
        served_model_name=served_model_name or str(model),
        max_tokens_limit=max_tokens_limit,
        default_max_tokens=min(default_max_tokens, max_tokens_limit),
        max_pending=max_pending,
        max_num_seqs=max_num_seqs,
        max_body_bytes=max_body_bytes,
        image_limits=image_limits or ImageLimits(),
        api_key=api_key,
        allow_remote_images=allow_remote_images or image_fetcher is not None,
        remote_image_timeout=remote_image_timeout,
        max_prompt_tokens=max_prompt_tokens,
        request_timeout=request_timeout,
    )
    if image_fetcher is None and allow_remote_images:
        image_fetcher = RemoteImageFetcher(
            max_bytes=config.image_limits.max_bytes, timeout=remote_image_timeout
        )
    # The thread's queue holds a turn of each running generation as well as
    # other jobs: bounded by max_pending alone, requests that never waited
    # were refused with 503 whenever max_pending < max_num_seqs.
    mlx_thread = thread or MLXThread(
        name="mlx-pinned", max_pending=max_pending + max_num_seqs
    )
    gate = BatchGate(max_num_seqs, max_pending)
    metrics = ServerMetrics(mlx_thread, gate)
    turns = LoopTurns()
    routes = [
        Route("/health", functools.partial(_health, mlx_thread), methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
        Route("/v1/models", functools.partial(_models, config), methods=["GET"]),
        Route(
            "/v1/models/{model_id:path}",
            functools.partial(_model, config),
            methods=["GET"],
        ),
        Route(
            "/v1/chat/completions",
            ChatEndpoint(
                config,
                mlx_thread,
                gate,
                fetch=image_fetcher,
                metrics=metrics,
                turns=turns,
            ),
            methods=["POST"],
        ),
    ]
    middleware = [
        Middleware(MetricsMiddleware, metrics=metrics),
        Middleware(
            MLXThreadMiddleware,
            thread=mlx_thread,
            startup={
                "model": functools.partial(engine.load, config.model),
                **({"gc_frozen": _freeze_gc} if freeze_gc else {}),
            },
            drain_timeout=drain_timeout,
        ),
    ]
    if api_key is not None:
        middleware.append(Middleware(_APIKeyMiddleware, api_key=api_key))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.config = config
    app.state.mlx_thread = mlx_thread
    app.state.gate = gate
    app.state.metrics = metrics
    app.state.loop_turns = turns
    return app


def _freeze_gc() -> int:
    """Collect once, then freeze what is left; the number of frozen objects."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d objects out of later garbage collections", frozen)
    return frozen


async def _health(thread: MLXThread, request: Request) -> Response:
    if thread.closed:
        return _error_response(
            APIError(503, "The MLX thread is not running: restart the server.")
        )
    if "model" not in request.scope.get("state", {}):
        return _error_response(APIError(503, "The model is not loaded yet."))
    stats = thread.statistics()
    return JSONResponse(
        {"status": "ok", "pending": stats.pending, "open_streams": stats.open_streams}
    )


def _model_card(config: ServerConfig, request: Request) -> dict[str, Any]:
    loaded = request.scope.get("state", {}).get("model")
    created = int(getattr(loaded, "loaded_at", None) or time.time())
    return {
        "id": config.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "mlx-pinned",
    }


async def _models(config: ServerConfig, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(config, request)]})


async def _model(config: ServerConfig, request: Request) -> Response:
    model_id = request.path_params["model_id"]
    if model_id != config.served_model_name:
        return _error_response(model_not_found(model_id, config))
    return JSONResponse(_model_card(config, request))


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: "Unknown URL: see /v1/models and /v1/chat/completions."}.get(
        exc.status_code, str(exc.detail)
    )
    if exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    error = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
    return _error_response(error)  # 405 keeps its Allow header


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return _error_response(
        APIError(500, "The server had an error while processing your request.")
    )


class _APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every HTTP route except ``/health``.

    The key is compared in constant time.
    """

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
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
        await _error_response(error)(scope, receive, send)
