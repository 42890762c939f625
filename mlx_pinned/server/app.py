"""The server app: wiring only, built from mlx-pinned's public pieces
(``MLXThread``, ``MLXThreadMiddleware``) and Starlette. Several models share
one MLX thread, each with its own engine and gate; every kind's routes come
from the :mod:`.kinds` registry. ``create_app`` runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from mlx_pinned import MLXThread
from mlx_pinned.middleware import MLXThreadMiddleware

from .config import ModelSettings, ServerConfig
from .engine import BatchEngine
from .engine.memory import (
    check_start_up_budget,
    limit_buffer_cache,
    release,
    stored_weight_bytes,
)
from .failures import UnavailableError
from .http.door import Wiring
from .http.errors import APIError
from .http.gate import MemoryBudget
from .http.health import Readiness, health, live
from .http.metrics import MetricsMiddleware, ServerMetrics
from .http.ollama import OllamaModels
from .http.ollama import routes as ollama_routes
from .http.outbox import Outbox
from .http.playground import routes as playground_routes
from .http.residency import Residency, StartUpRefusal
from .http.routes import (
    APIKeyMiddleware,
    ErrorEdge,
    load_model,
    model,
    models,
    unload_model,
)
from .http.served_models import BatchGate, ModelSlot, ServedModel, ServedModels
from .http.takeover import Takeovers
from .http.turns import LoopTurns
from .inputs.audio import load_audio, load_audios
from .inputs.images import Fetcher, load_images
from .inputs.remote import RemoteImageFetcher
from .inputs.videos import load_videos
from .kinds import KINDS, kind_named
from .media import Decoders
from .resident import Resident

__all__ = ["create_app"]

logger = logging.getLogger("mlx_pinned.server")


def create_app(
    model_path: str | Path | Sequence[str | Path] | None = None,
    config: ServerConfig | None = None,
    *,
    thread: MLXThread | None = None,
    image_fetcher: Fetcher | None = None,
    engine_factory: Callable[[ModelSettings, MLXThread], BatchEngine] | None = None,
    **settings: Any,
) -> Starlette:
    """Create the server app for one model, or several.

    Each model is loaded on the MLX thread when the app's lifespan starts, in
    order (run the app under uvicorn, or drive its lifespan in tests), or on
    its first request with ``load_on_first_use``; a failed start-up load
    fails the start-up with the reason. At shutdown in-flight requests get
    ``in_flight_timeout`` seconds to finish, then the thread is closed.

    Args:
        model_path: A local model folder or a Hugging Face hub id (the
            config's ``model``), or a sequence of them.
        config: The settings; the defaults when None.
        thread: The MLX thread to run on (default: a new one). The app's
            lifespan starts and closes it.
        image_fetcher: Fetches remote images instead of the default
            :class:`RemoteImageFetcher` (implies ``allow_remote_images``).
        engine_factory: Loads a chat model and makes its engine on the MLX
            thread instead of ``BatchEngine.load``, e.g. the tensor-parallel
            ``engine.distributed.Leader.load``.
        **settings: Fields of :class:`ServerConfig` to set (on top of
            ``config``), e.g. ``max_num_seqs=8``.

    Returns:
        A Starlette app; ``app.state.config`` is its :class:`ServerConfig`,
        ``app.state.models`` the served models, ``app.state.readiness`` what
        ``/health`` answers (its ``drain()`` turns it 503 ahead of a stop).

    Raises:
        ValueError: A setting out of its range (the message names it).
    """
    if model_path is not None:
        if isinstance(model_path, (str, Path)):
            settings["model"] = str(model_path)
        else:
            settings["model"] = tuple(str(path) for path in model_path)
    if image_fetcher is not None:
        settings["allow_remote_images"] = True
    config = dataclasses.replace(config or ServerConfig(), **settings)
    if not all(config.models):
        raise ValueError("model is empty: give a model folder or a hub id")
    mlx_thread = thread or MLXThread(name="mlx-pinned", max_pending=config.thread_bound)
    each = [config.for_model(index) for index in range(len(config.models))]
    loads = [_load(own, mlx_thread, engine_factory) for own in each]
    budget = MemoryBudget.of(config, each)
    served = ServedModels(
        [
            ServedModel(
                own.name,
                # A gate per model: its batch and its waiting room are its
                # own, so a flood of one model's requests never holds another's.
                BatchGate(
                    own.max_num_seqs,
                    own.max_pending,
                    retry_after=own.retry_after,
                    budget=budget,
                ),
                _slot(own, mlx_thread, loads[index]),
                kind=own.kind,
            )
            for index, own in enumerate(each)
        ]
    )
    # A model's draft model (speculative decoding) is loaded with it.
    at_start_up = [
        path
        for own in each
        if not own.load_on_first_use
        for path in (own.path, own.draft_model)
        if path is not None
    ]
    settle = None

    async def prepare() -> None:
        explicit = config.mlx_cache_bytes is not None
        limit = config.mlx_cache_budget
        await mlx_thread.run(limit_buffer_cache, limit, explicit=explicit)
        if config.max_model_bytes is not None and at_start_up:
            # Before any load: a start-up past the budget fails at once.
            budget = config.max_model_bytes
            await mlx_thread.run(check_start_up_budget, tuple(at_start_up), budget)

    if config.freeze_gc:
        settle = functools.partial(mlx_thread.run, _freeze_gc)
    residency = Residency(
        served,
        functools.partial(mlx_thread.run, release),
        budget=config.max_model_bytes,
        retry_after=config.retry_after,
        load_wait=config.load_wait,
        prepare=prepare,
        settle=settle,
    )
    budget.served = served
    metrics = ServerMetrics(mlx_thread, served, budget)
    readiness = Readiness(mlx_thread, served, retry_after=config.retry_after)
    turns = LoopTurns()
    image_fetch = _fetcher(config, image_fetcher, config.image_limits.max_bytes)
    video_fetch = _fetcher(config, image_fetcher, config.max_video_bytes)
    decoders = Decoders(
        images=functools.partial(
            load_images, limits=config.image_limits, fetch=image_fetch
        ),
        videos=functools.partial(
            load_videos, limits=config.video_limits, fetch=video_fetch
        ),
        audios=functools.partial(load_audios, limits=config.audio_limits),
        audio=functools.partial(load_audio, limits=config.audio_limits),
    )
    wiring = Wiring(
        config,
        mlx_thread,
        served,
        residency,
        turns,
        decoders,
        metrics,
        Outbox.of(config),
        takeovers=Takeovers.of(config),
    )
    routes = [
        Route("/health", functools.partial(health, readiness), methods=["GET"]),
        Route("/livez", functools.partial(live, readiness), methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
        Route("/v1/models", functools.partial(models, served), methods=["GET"]),
        Route(
            "/v1/models/{model_id:path}/load",
            functools.partial(load_model, served, residency),
            methods=["POST"],
        ),
        Route(
            "/v1/models/{model_id:path}/unload",
            functools.partial(unload_model, served, residency),
            methods=["POST"],
        ),
        Route(
            "/v1/models/{model_id:path}",
            functools.partial(model, served),
            methods=["GET"],
        ),
        *ollama_routes(wiring),
    ]
    for kind in KINDS.values():
        routes += kind.routes(wiring) if kind.routes is not None else []
    # The playground: the chat page at / and its assets, open without the API
    # key (the page sends it).
    if config.playground:
        routes += playground_routes()
    routes.append(OllamaModels.root())  # Ollama's "is it running" (else its page)
    metrics.mount(routes)
    # Every refusal outside a door, in the shape of its route's API.
    errors = ErrorEdge(routes, retry_after=config.retry_after)
    middleware = [
        Middleware(MetricsMiddleware, metrics=metrics),
        Middleware(
            MLXThreadMiddleware,
            thread=mlx_thread,
            drain_timeout=config.in_flight_timeout,
            refusal=errors.refusal,
        ),
        Middleware(StartUpRefusal, residency=residency),
    ]
    if config.api_key is not None:
        middleware.append(
            Middleware(APIKeyMiddleware, api_key=config.api_key, errors=errors)
        )
    if config.allowed_origins:
        # Outermost: a preflight carries no API key and needs no model.
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.allowed_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["*"],
                max_age=600,
            ),
        )
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            **dict.fromkeys(
                (HTTPException, APIError, UnavailableError), errors.refused
            ),
            Exception: errors.server_error,
        },
        lifespan=functools.partial(_lifespan, residency, wiring.closing),
    )
    app.state.config = config
    app.state.mlx_thread = mlx_thread
    app.state.models = served
    app.state.residency = residency
    app.state.gate = next(iter(served)).gate  # the first (or only) model's
    app.state.metrics = metrics
    app.state.memory = budget
    app.state.readiness = readiness
    app.state.errors = errors
    app.state.loop_turns = turns
    app.state.outbox = wiring.outbox
    app.state.takeovers = wiring.takeovers
    return app


@contextlib.asynccontextmanager
async def _lifespan(
    residency: Residency,
    closing: Sequence[Callable[[], Awaitable[None]]],
    app: Starlette,
) -> AsyncIterator[None]:
    """The models' lifespan, then what the doors opened, closed."""
    try:
        async with residency.running(app):
            yield
    finally:
        for close in closing:
            await close()


def _load(
    own: ModelSettings,
    thread: MLXThread,
    engine_factory: Callable[[ModelSettings, MLXThread], BatchEngine] | None,
) -> Callable[[], Resident]:
    """Loads a model and makes its kind's engine, on the MLX thread."""
    load = kind_named(own.kind).load
    if own.kind == "chat" and engine_factory is not None:
        load = engine_factory
    assert load is not None, f"the {own.kind} kind has no loader"
    return functools.partial(load, own, thread)


def _slot(
    own: ModelSettings, thread: MLXThread, load: Callable[[], Resident]
) -> ModelSlot:
    """A model's slot: its load and its measure each run on the MLX thread."""

    async def load_engine() -> Resident:
        return await thread.run(load)

    async def measure() -> int:
        paths = [own.path, *([own.draft_model] if own.draft_model else [])]
        return sum([await thread.run(stored_weight_bytes, path) for path in paths])

    return ModelSlot(
        own.name,
        load_engine,
        measure,
        at_start_up=not own.load_on_first_use,
        pinned=own.pinned,
        idle_timeout=own.idle_unload_timeout,
    )


def _fetcher(
    config: ServerConfig, fetch: Fetcher | None, max_bytes: int
) -> Fetcher | None:
    """``fetch``, or where remote media is allowed the default fetcher of at
    most ``max_bytes`` a file."""
    if fetch is None and config.allow_remote_images:
        return RemoteImageFetcher(
            max_bytes=max_bytes, timeout=config.remote_image_timeout
        )
    return fetch


def _freeze_gc() -> int:
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d objects out of later garbage collections", frozen)
    return frozen
