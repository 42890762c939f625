"""``GET /metrics``: the server's counters in Prometheus' text format.

One :class:`~prometheus_client.CollectorRegistry` per app, never the global
one, so two apps in one process (tests, or two models) keep their own numbers.
Counters and histograms are updated on the event loop as requests end; the
queue and the MLX thread are read when a scrape arrives. Everything here runs
on the event loop and never waits for the MLX thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import Response

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from starlette.requests import Request
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from mlx_pinned import MLXThread

    from ..events import Engine, EngineCounters
    from .wire import RequestLog

__all__ = ["MetricsMiddleware", "ServerMetrics"]

_ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/chat/completions"})
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Gate(Protocol):
    @property
    def waiting(self) -> int: ...
    @property
    def busy(self) -> bool: ...


class ServerMetrics:
    """The metrics of one app, in their own registry.

    Metric names (all prefixed ``mlx_pinned_``): ``requests_total{route,
    status}``; ``prompt_tokens_total`` and ``generated_tokens_total``;
    ``time_to_first_token_seconds``, ``request_duration_seconds`` (completed
    chat requests, end to end) and ``queue_wait_seconds`` histograms;
    gauges ``queue_depth`` (requests waiting for the model),
    ``active_generations``, ``mlx_thread_pending_jobs``,
    ``mlx_thread_open_streams``, ``mlx_thread_up`` and
    ``mlx_thread_busy_fraction`` (since the previous scrape); and the
    counter ``mlx_thread_busy_seconds_total`` (``rate()`` of it is the busy
    fraction over any window). Once the model is loaded: gauges
    ``kv_cache_bytes`` (the rows' KV), ``batch_rows`` and
    ``prompt_cache_bytes``, counters ``prompt_cache_hits_total``,
    ``prompt_cache_misses_total`` and ``prompt_cache_reused_tokens_total``.

    Args:
        thread: The app's MLX thread.
        gate: The app's gate: ``waiting`` requests and whether one is ``busy``
            (``active``, when it has it, counts generations).
    """

    def __init__(self, thread: MLXThread, gate: _Gate) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "mlx_pinned_requests",
            "HTTP requests answered, by route and status (499: the client left).",
            ["route", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "mlx_pinned_prompt_tokens",
            "Prompt tokens of chat completions, images included.",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "mlx_pinned_generated_tokens",
            "Tokens generated, for every request (cancelled ones included).",
            registry=registry,
        )
        self.ttft = Histogram(
            "mlx_pinned_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "mlx_pinned_request_duration_seconds",
            "Chat completions answered with 200, from arrival to the last byte.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "mlx_pinned_queue_wait_seconds",
            "Time a chat completion waited for the model.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self._live = _LiveCollector(thread, gate)
        registry.register(self._live)

    def observe(self, log: RequestLog) -> None:
        """Record a finished chat request from its log line."""
        self.prompt_tokens.inc(log.prompt_tokens)
        self.generated_tokens.inc(log.completion_tokens)
        if log.first_token is not None:
            self.ttft.observe(log.first_token - log.start)
        if log.queued is not None:
            self.queue_wait.observe(log.queued)
        if log.status == 200:
            self.latency.observe(time.perf_counter() - log.start)

    async def endpoint(self, request: Request) -> Response:
        """``GET /metrics``; the engine's numbers are read from the lifespan
        state's ``model``, once it is loaded."""
        self._live.engine = request.scope.get("state", {}).get("model")
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _LiveCollector(Collector):
    """Values read at scrape time from the gate and the MLX thread."""

    def __init__(self, thread: MLXThread, gate: _Gate) -> None:
        self.thread = thread
        self.gate = gate
        self.engine: Engine | None = None  # set by each scrape
        self._last = (time.perf_counter(), thread.statistics().busy_time)

    def collect(self) -> Iterator[Metric]:
        stats = self.thread.statistics()
        now = time.perf_counter()
        then, busy_then = self._last
        self._last = (now, stats.busy_time)
        fraction = (stats.busy_time - busy_then) / (now - then) if now > then else 0.0
        gate = self.gate
        active = getattr(gate, "active", int(gate.busy))
        yield _gauge("queue_depth", "Requests waiting for the model.", gate.waiting)
        yield _gauge("active_generations", "Generations running now.", active)
        yield _gauge(
            "mlx_thread_pending_jobs", "Jobs queued on the MLX thread.", stats.pending
        )
        yield _gauge(
            "mlx_thread_open_streams",
            "Generators open on the MLX thread.",
            stats.open_streams,
        )
        yield _gauge(
            "mlx_thread_up", "1 while the MLX thread runs.", int(not self.thread.closed)
        )
        yield _gauge(
            "mlx_thread_busy_fraction",
            "Share of the time since the previous scrape the MLX thread ran jobs.",
            min(1.0, max(0.0, fraction)),
        )
        yield CounterMetricFamily(
            "mlx_pinned_mlx_thread_busy_seconds",
            "Seconds the MLX thread spent running jobs.",
            value=stats.busy_time,
        )
        if self.engine is not None:
            yield from _engine_metrics(self.engine.counters())


def _engine_metrics(counters: EngineCounters) -> Iterator[Metric]:
    yield _gauge("kv_cache_bytes", "Bytes of KV held by the rows.", counters.kv_bytes)
    yield _gauge("batch_rows", "Generations in the batch or joining it.", counters.rows)
    yield _gauge(
        "prompt_cache_bytes",
        "Bytes of prompt KV the prompt cache holds.",
        counters.prompt_cache_bytes,
    )
    for name, text, value in (
        ("hits", "Requests that reused cached prompt KV.", counters.prompt_cache_hits),
        (
            "misses",
            "Requests that found no cached prefix.",
            counters.prompt_cache_misses,
        ),
        (
            "reused_tokens",
            "Prompt tokens taken from the prompt cache, not prefilled.",
            counters.prompt_cache_reused_tokens,
        ),
    ):
        yield CounterMetricFamily(f"mlx_pinned_prompt_cache_{name}", text, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mlx_pinned_{name}", documentation, value=value)


def route_of(path: str) -> str:
    """The route label of a path: one of the app's routes, or ``other``."""
    if path in _ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model_id}"
    return "other"


class MetricsMiddleware:
    """Counts every HTTP request by route and status, outermost, so that
    401s, 413s and the 503s of a draining server are counted too."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            label = str(status) if status else "499"
            self.metrics.requests.labels(route_of(scope["path"]), label).inc()
