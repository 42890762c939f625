"""``GET /metrics``: the server's counters in Prometheus' text format.

Event loop only; never waits for the MLX thread. One registry per app, never
the global one, so two apps in one process keep their own numbers. Counters
and histograms are updated as requests end; the gates, the engines and the
MLX thread are read when a scrape arrives.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
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
from starlette.routing import Route

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from starlette.requests import Request
    from starlette.routing import BaseRoute
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from mlx_pinned import MLXThread

    from ..resident import EngineCounters
    from .gate import MemoryBudget
    from .served_models import ServedModels
    from .wire import RequestLog

__all__ = ["MetricsMiddleware", "ServerMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Kept(Protocol):
    """What a store keeps, as the metrics read it (the Responses store)."""

    @property
    def bytes(self) -> int: ...

    def __len__(self) -> int: ...


class ServerMetrics:
    """The metrics of one app, in their own registry, all prefixed
    ``mlx_pinned_``; each metric's help text says what it counts.

    What belongs to one model carries a ``model`` label (the served name),
    and a request's tokens and times an ``api`` label too (a door's
    :attr:`~.door.Door.api`). An engine's numbers appear once its model is
    loaded; the Responses store's once :attr:`store` is set.
    """

    def __init__(
        self,
        thread: MLXThread,
        models: ServedModels,
        budget: MemoryBudget | None = None,
    ) -> None:
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
            "Prompt tokens of generations, images included, by model and API.",
            ["model", "api"],
            registry=registry,
        )
        self.generated_tokens = Counter(
            "mlx_pinned_generated_tokens",
            "Tokens generated, for every request (cancelled ones included).",
            ["model", "api"],
            registry=registry,
        )
        self.ttft = Histogram(
            "mlx_pinned_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            ["model", "api"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "mlx_pinned_request_duration_seconds",
            "Generations answered with 200, from arrival to the last byte.",
            ["model", "api"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "mlx_pinned_queue_wait_seconds",
            "Time a generation waited for the model.",
            ["model", "api"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.models = models
        self._paths: list[tuple[re.Pattern[str], str]] = []
        self._live = _LiveCollector(thread, models, budget)
        registry.register(self._live)

    @property
    def store(self) -> Kept | None:
        """The Responses store whose size the gauges report."""
        return self._live.store

    @store.setter
    def store(self, store: Kept | None) -> None:
        self._live.store = store

    def mount(self, routes: Sequence[BaseRoute]) -> None:
        """Label requests by ``routes``' paths, and start the series of each
        door's API of each model of its kind at 0 (``rate()`` needs a first
        sample)."""
        found = [route for route in routes if isinstance(route, Route)]
        # A path's converters are left out: "/v1/models/{model_id}".
        self._paths = [
            (route.path_regex, re.sub(r":\w+}", "}", route.path)) for route in found
        ]
        for route in found:
            api = getattr(route.endpoint, "api", None)
            kind = getattr(route.endpoint, "kind", None)
            for model in self.models if api is not None else ():
                if model.kind == kind:
                    for metric in self._per_model():
                        metric.labels(model.name, api)

    def route_of(self, path: str) -> str:
        found = (label for regex, label in self._paths if regex.match(path))
        return next(found, "other")

    def _per_model(self) -> tuple[Counter | Histogram, ...]:
        return (
            self.prompt_tokens,
            self.generated_tokens,
            self.ttft,
            self.latency,
            self.queue_wait,
        )

    def observe(self, log: RequestLog) -> None:
        """Record a finished chat request from its log line; one that named
        no served model (refused before) has nothing per model to record."""
        api = log.api
        if log.model is None or api is None:
            return
        model = log.model
        self.prompt_tokens.labels(model, api).inc(log.prompt_tokens)
        self.generated_tokens.labels(model, api).inc(log.completion_tokens)
        if log.first_token is not None:
            self.ttft.labels(model, api).observe(log.first_token - log.start)
        if log.queued is not None:
            self.queue_wait.labels(model, api).observe(log.queued)
        if log.status == 200:
            self.latency.labels(model, api).observe(time.perf_counter() - log.start)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _LiveCollector(Collector):
    """Values read at scrape time from the gates, the engines and the MLX
    thread."""

    def __init__(
        self, thread: MLXThread, models: ServedModels, budget: MemoryBudget | None
    ) -> None:
        self.thread = thread
        self.models = models
        self.budget = budget
        self.store: Kept | None = None
        self._last = (time.perf_counter(), thread.statistics().busy_time)

    def collect(self) -> Iterator[Metric]:
        stats = self.thread.statistics()
        now = time.perf_counter()
        then, busy_then = self._last
        self._last = (now, stats.busy_time)
        fraction = (stats.busy_time - busy_then) / (now - then) if now > then else 0.0
        queued = _per_model("queue_depth", "Requests waiting for the model.")
        active = _per_model("active_generations", "Generations running now.")
        usage = _per_model(
            "batch_usage_ratio",
            "Share of the batch's rows (max_num_seqs) in use; 1: new requests wait.",
        )
        for model in self.models:
            queued.add_metric([model.name], model.gate.waiting)
            active.add_metric([model.name], model.gate.active)
            gate = model.gate
            usage.add_metric([model.name], gate.active / gate.max_num_seqs)
        yield queued
        yield active
        yield usage
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
        loaded = []
        for model in self.models:
            engine = model.engine()
            if engine is not None:
                loaded.append((model.name, engine.counters()))
        yield from self._residency()
        if self.budget is not None:
            yield from _memory_metrics(self.budget)
        if loaded:
            yield from _engine_metrics(loaded)
        if self.store is not None:
            yield _gauge(
                "responses_store_items", "Responses the store keeps.", len(self.store)
            )
            yield _gauge(
                "responses_store_bytes",
                "Bytes the store's kept responses take (their JSON).",
                self.store.bytes,
            )

    def _residency(self) -> Iterator[Metric]:
        flag = _per_model("model_loaded", "1 while the model is loaded.")
        weights = _per_model(
            "model_weight_bytes", "Bytes of the model's weights while it is loaded."
        )
        counts = {
            name: CounterMetricFamily(
                f"mlx_pinned_model_{name}", text, labels=["model"]
            )
            for name, text in (
                ("loads", "Loads of the model (its start-up load included)."),
                ("unloads", "Unloads of the model (idle, or to make room)."),
                ("load_failures", "Loads of the model that failed."),
            )
        }
        for model in self.models:
            engine = model.engine()
            flag.add_metric([model.name], int(engine is not None))
            weights.add_metric([model.name], engine.weight_bytes if engine else 0)
            slot = model.slot
            counts["loads"].add_metric([model.name], slot.loads)
            counts["unloads"].add_metric([model.name], slot.unloads)
            counts["load_failures"].add_metric([model.name], slot.failures)
        yield flag
        yield weights
        yield from counts.values()


def _memory_metrics(budget: MemoryBudget) -> Iterator[Metric]:
    yield _gauge(
        "memory_charged_bytes",
        "Bytes the requests in flight are charged (KV and media), all models.",
        budget.charged,
    )
    yield _gauge(
        "memory_budget_bytes",
        "What they may be charged (--max-kv-bytes, and what the prompt caches "
        "lent); 0: no limit.",
        0 if budget.limit() is None else budget.capacity(),
    )
    yield _gauge(
        "memory_lent_bytes",
        "Bytes the prompt caches keep free of their budgets for the charges.",
        budget.lent,
    )


def _engine_metrics(loaded: list[tuple[str, EngineCounters]]) -> Iterator[Metric]:
    gauges = (
        ("kv_cache_bytes", "Bytes of KV held by the rows.", "kv_bytes"),
        (
            "kv_cache_bytes_per_token",
            "Bytes of KV one token takes (quantized under --kv-bits).",
            "kv_bytes_per_token",
        ),
        ("batch_rows", "Generations in the batch or joining it.", "rows"),
        (
            "prompt_cache_bytes",
            "Bytes of prompt KV the prompt cache holds.",
            "prompt_cache_bytes",
        ),
        (
            "image_cache_bytes",
            "Bytes of vision-tower outputs the image cache holds.",
            "image_cache_bytes",
        ),
        (
            "disk_cache_bytes",
            "Bytes of prompt KV and image files the disk tier holds.",
            "disk_cache_bytes",
        ),
    )
    for name, text, field in gauges:
        gauge = _per_model(name, text)
        for model, counters in loaded:
            gauge.add_metric([model], getattr(counters, field))
        yield gauge
    counted = (
        ("hits", "Requests that reused cached prompt KV."),
        ("misses", "Requests that found no cached prefix."),
        ("reused_tokens", "Prompt tokens taken from the prompt cache, not prefilled."),
    )
    for name, text in counted:
        counter = CounterMetricFamily(
            f"mlx_pinned_prompt_cache_{name}", text, labels=["model"]
        )
        for model, counters in loaded:
            counter.add_metric([model], getattr(counters, f"prompt_cache_{name}"))
        yield counter
    # MLX's allocator is the process's: one sample, whichever engine read it.
    active, cached, peak = loaded[0][1].mlx_memory
    yield _gauge("mlx_active_bytes", "Bytes of MLX arrays alive now.", active)
    yield _gauge(
        "mlx_cache_bytes", "Bytes MLX keeps freed for reuse (its buffer cache).", cached
    )
    yield _gauge("mlx_peak_bytes", "Most bytes of MLX arrays alive at once.", peak)
    yield from _decode_metrics(loaded)


def _decode_metrics(loaded: list[tuple[str, EngineCounters]]) -> Iterator[Metric]:
    counted = (
        ("decode_steps", "Decode steps run.", "decode_steps"),
        ("decode_tokens", "Tokens the decode steps gave.", "decoded_tokens"),
        (
            "speculative_steps",
            "Decode steps that verified draft tokens.",
            "speculative_steps",
        ),
        ("draft_tokens", "Draft tokens verified.", "draft_tokens"),
        ("draft_accepted_tokens", "Draft tokens kept.", "accepted_tokens"),
    )
    for name, text, field in counted:
        counter = CounterMetricFamily(f"mlx_pinned_{name}", text, labels=["model"])
        for model, counters in loaded:
            counter.add_metric([model], getattr(counters, field))
        yield counter
    per_step = _per_model(
        "speculative_tokens_per_step",
        "Tokens a row got from a speculative step, on average.",
    )
    ratio = _per_model(
        "draft_acceptance_ratio", "Share of the draft tokens verified that were kept."
    )
    for model, counters in loaded:
        rows, drafts = counters.speculative_rows, counters.draft_tokens
        kept = counters.accepted_tokens
        per_step.add_metric([model], (rows + kept) / rows if rows else 0)
        ratio.add_metric([model], kept / drafts if drafts else 0)
    yield per_step
    yield ratio


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mlx_pinned_{name}", documentation, value=value)


def _per_model(name: str, documentation: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mlx_pinned_{name}", documentation, labels=["model"])


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
            route = self.metrics.route_of(scope["path"])
            self.metrics.requests.labels(route, label).inc()
