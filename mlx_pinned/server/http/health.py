"""Readiness and liveness: ``GET /health`` (for balancers) and ``GET /livez``
(for process managers: a slow load is never mistaken for a hung process).

The endpoints run on the event loop. :meth:`Readiness.drain` and
:meth:`Readiness.fail` only set a value the next probe reads, so any thread
may call them (a signal handler, a watchdog).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from ..failures import ModelNotLoadedError
from .errors import APIError, shutting_down, thread_unavailable

if TYPE_CHECKING:
    from starlette.requests import Request

    from mlx_pinned import MLXThread

    from .served_models import ServedModels

__all__ = ["Readiness", "health", "live"]


class Readiness:
    """Whether this server should get new requests, and why not: the one
    place that decides it.

    Ready when the MLX thread runs, every model loaded at start-up is loaded
    (those loaded on first use are not waited for), the server is not
    draining and nothing marked it down.
    """

    def __init__(
        self, thread: MLXThread, served: ServedModels, *, retry_after: int = 1
    ) -> None:
        self.thread = thread
        self.served = served
        self.retry_after = retry_after
        self._draining = False
        self._down: APIError | None = None

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Stop being ready for good (SIGTERM); requests keep being served
        meanwhile."""
        self._draining = True

    def fail(self, reason: str, *, code: str = "server_unavailable") -> None:
        """Mark the server unfit for traffic for good: ``/health`` answers 503
        with ``reason`` (one sentence: what broke); the first one is kept."""
        if self._down is None:
            self._down = APIError(503, reason, code=code)

    def refusal(self) -> Exception | None:
        """What ``/health`` answers while not ready; None when it is."""
        if self.thread.closed:
            return thread_unavailable()
        if self._down is not None:
            return self._down
        if self._draining:
            return shutting_down()
        for item in self.served:
            slot = item.slot  # a start-up model not loaded yet (not unloaded)
            if slot.at_start_up and slot.engine is None and slot.loads == 0:
                return ModelNotLoadedError(item.name, retry_after=self.retry_after)
        return None

    def alive(self) -> bool:
        return not self.thread.closed


async def health(readiness: Readiness, request: Request) -> Response:
    """200 while ready, with each model's state; else the refusal, a 503."""
    refusal = readiness.refusal()
    if refusal is not None:
        raise refusal
    stats = readiness.thread.statistics()
    models = {}
    for item in readiness.served:
        engine = item.engine()
        counters = engine.counters() if engine is not None else None
        entry: dict[str, Any] = {
            "loaded": counters is not None,
            "rows": counters.rows if counters else 0,
            "kv_bytes": counters.kv_bytes if counters else 0,
            "kv_bytes_per_token": counters.kv_bytes_per_token if counters else 0,
        }
        if counters is not None and counters.ranks:  # tensor parallel
            entry["ranks"] = list(counters.ranks)
        models[item.name] = entry
    return JSONResponse(
        {
            "status": "ok",
            "pending": stats.pending,
            "open_streams": stats.open_streams,
            "models": models,
        }
    )


async def live(readiness: Readiness, request: Request) -> Response:
    """200 while the process can serve, loading and draining included; 503
    once its MLX thread stopped."""
    if not readiness.alive():
        raise thread_unavailable()
    return JSONResponse({"status": "alive"})
