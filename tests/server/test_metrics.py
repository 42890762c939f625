"""``GET /metrics``: scraped and parsed as Prometheus does."""

from __future__ import annotations

import anyio
import mlx.core as mx
import pytest
from prometheus_client import REGISTRY

from mlx_pinned.server.engine.memory import limit_buffer_cache

from .conftest import MODEL, assert_error, replace_generation, until, vision_body
from .kit import Serve, SlowModel, scrape, value

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
CHAT_API = "chat_completions"


class TestMetrics:
    async def test_prompt_cache_and_kv_are_visible(self, serve: Serve) -> None:
        async with serve(prompt_cache_bytes=2**26) as served:
            before = await scrape(served)
            assert value(before, "mlx_pinned_prompt_cache_hits_total", model=MODEL) == 0
            usages = []
            for _ in range(2):  # the second reuses the first's prompt
                response = await served.chat(vision_body(3))
                assert response.status_code == 200
                usages.append(response.json()["usage"])
            samples = await scrape(served)
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        assert cached[0] == 0
        assert cached[1] == value(
            samples, "mlx_pinned_prompt_cache_reused_tokens_total", model=MODEL
        )
        assert 0 < cached[1] < usages[1]["prompt_tokens"]
        assert value(samples, "mlx_pinned_prompt_cache_hits_total", model=MODEL) == 1
        assert value(samples, "mlx_pinned_prompt_cache_misses_total", model=MODEL) == 1
        assert (
            value(samples, "mlx_pinned_prompt_cache_reused_tokens_total", model=MODEL)
            > 10
        )
        assert value(samples, "mlx_pinned_prompt_cache_bytes", model=MODEL) > 0
        assert value(samples, "mlx_pinned_batch_rows", model=MODEL) == 0
        assert ("mlx_pinned_kv_cache_bytes", (("model", MODEL),)) in samples

    async def test_mlx_memory_and_the_image_cache_are_visible(
        self, serve: Serve
    ) -> None:
        async with serve(image_cache_bytes=2**24) as served:
            response = await served.chat(vision_body(3))
            assert response.status_code == 200
            samples = await scrape(served)
        active = value(samples, "mlx_pinned_mlx_active_bytes")
        # The model's weights are alive at least; the peak holds them too.
        assert active >= served.engine.loaded.weight_bytes > 0
        assert value(samples, "mlx_pinned_mlx_peak_bytes") >= active
        assert value(samples, "mlx_pinned_mlx_cache_bytes") >= 0
        assert value(samples, "mlx_pinned_image_cache_bytes", model=MODEL) > 0

    async def test_the_buffer_cache_keeps_what_the_setting_says(
        self, serve: Serve
    ) -> None:
        own = mx.set_cache_limit(2**20)  # what this process had: restored below
        try:
            async with serve(mlx_cache_bytes=0) as served:
                response = await served.chat(vision_body(8))
                assert response.status_code == 200
                samples = await scrape(served)
                none_kept = mx.set_cache_limit(2**20)
                # Unset, it never raises MLX's own limit, only lowers it.
                run = served.thread.run
                higher = await run(limit_buffer_cache, 2**40, explicit=False)
                lower = await run(limit_buffer_cache, 4096, explicit=False)
        finally:
            mx.set_cache_limit(own)
        assert none_kept == 0
        assert value(samples, "mlx_pinned_mlx_cache_bytes") == 0
        assert higher == 2**20
        assert lower == 4096

    async def test_the_responses_store_is_visible(self, serve: Serve) -> None:
        async with serve() as served:
            empty = await scrape(served)
            body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
            for store in (True, True, False):
                answer = await served.client.post(
                    "/v1/responses", json={**body, "store": store}
                )
                assert answer.status_code == 200, answer.text
            samples = await scrape(served)
            kept = served.app.state.metrics.store
        assert value(empty, "mlx_pinned_responses_store_items") == 0
        assert value(empty, "mlx_pinned_responses_store_bytes") == 0
        assert value(samples, "mlx_pinned_responses_store_items") == 2
        assert value(samples, "mlx_pinned_responses_store_bytes") == kept.bytes > 0

    async def test_counts_after_traffic(self, serve: Serve) -> None:
        async with serve() as served:
            first = await scrape(served)
            assert value(first, "mlx_pinned_mlx_thread_up") == 1
            assert value(first, "mlx_pinned_requests_total") == 0
            ok = (await served.chat(vision_body(5))).json()
            streamed = await served.chat(vision_body(3, stream=True))
            assert streamed.status_code == 200
            assert_error(
                await served.chat(vision_body(temperature=9)), 400, "temperature"
            )
            assert_error(await served.client.get("/nowhere"), 404)
            samples = await scrape(served)

            def requests(route: str, status: str) -> float:
                return value(
                    samples, "mlx_pinned_requests_total", route=route, status=status
                )

            assert requests(CHAT, "200") == 2
            assert requests(CHAT, "400") == 1
            assert requests("other", "404") == 1
            assert requests("/metrics", "200") == 1  # the first scrape
            assert (
                value(
                    samples,
                    "mlx_pinned_generated_tokens_total",
                    model=MODEL,
                    api=CHAT_API,
                )
                == 8
            )
            prompt = ok["usage"]["prompt_tokens"]
            assert (
                value(
                    samples, "mlx_pinned_prompt_tokens_total", model=MODEL, api=CHAT_API
                )
                == 2 * prompt
            )
            for histogram in (
                "mlx_pinned_time_to_first_token_seconds",
                "mlx_pinned_request_duration_seconds",
                "mlx_pinned_queue_wait_seconds",
            ):
                count = value(samples, f"{histogram}_count", model=MODEL, api=CHAT_API)
                assert count == 2
                total = value(samples, f"{histogram}_sum", model=MODEL, api=CHAT_API)
                assert total > 0 or "queue" in histogram
                bucket = value(
                    samples, f"{histogram}_bucket", le="+Inf", model=MODEL, api=CHAT_API
                )
                assert bucket == 2
            assert value(samples, "mlx_pinned_queue_depth", model=MODEL) == 0
            assert value(samples, "mlx_pinned_active_generations", model=MODEL) == 0
            busy = value(samples, "mlx_pinned_mlx_thread_busy_seconds_total")
            assert busy > 0
            fraction = value(samples, "mlx_pinned_mlx_thread_busy_fraction")
            assert 0 < fraction <= 1
            served.thread.shutdown()
            assert value(await scrape(served), "mlx_pinned_mlx_thread_up") == 0

    async def test_queue_depth_while_waiting(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        slow = SlowModel(step=0.01)
        replace_generation(monkeypatch, slow)
        async with serve() as served:
            gate = served.app.state.gate
            with anyio.fail_after(30):
                async with anyio.create_task_group() as group:
                    group.start_soon(served.chat, vision_body(4000))
                    # busy comes before the stream opens on the MLX thread
                    await until(lambda: served.thread.statistics().open_streams == 1)
                    for _ in range(2):
                        group.start_soon(served.chat, vision_body(2))
                    await until(lambda: gate.waiting == 2)
                    samples = await scrape(served)
                    slow.release.set()
            assert value(samples, "mlx_pinned_queue_depth", model=MODEL) == 2
            assert value(samples, "mlx_pinned_active_generations", model=MODEL) == 1
            assert value(samples, "mlx_pinned_mlx_thread_open_streams") == 1

    async def test_one_registry_per_app(self, serve: Serve) -> None:
        async with serve() as one, serve() as other:
            assert (await one.chat(vision_body(2))).status_code == 200
            assert (
                value(
                    await scrape(one),
                    "mlx_pinned_generated_tokens_total",
                    model=MODEL,
                    api=CHAT_API,
                )
                == 2
            )
            assert (
                value(
                    await scrape(other),
                    "mlx_pinned_generated_tokens_total",
                    model=MODEL,
                    api=CHAT_API,
                )
                == 0
            )
        assert (
            REGISTRY.get_sample_value(
                "mlx_pinned_generated_tokens_total", {"model": MODEL, "api": CHAT_API}
            )
            is None
        )

    async def test_each_api_has_its_own_series(self, serve: Serve) -> None:
        async with serve() as served:
            chat = await served.chat(vision_body(3))
            assert chat.status_code == 200
            legacy = await served.client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 5},
            )
            assert legacy.status_code == 200
            messages = await served.client.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hello"}],
                },
            )
            assert messages.status_code == 200
            samples = await scrape(served)
        generated = "mlx_pinned_generated_tokens_total"
        by_api = {
            api: value(samples, generated, model=MODEL, api=api)
            for api in ("chat_completions", "completions", "messages", "responses")
        }
        assert by_api == {
            "chat_completions": 3,
            "completions": legacy.json()["usage"]["completion_tokens"],
            "messages": messages.json()["usage"]["output_tokens"],
            "responses": 0,
        }

    async def test_behind_the_api_key(self, serve: Serve) -> None:
        async with serve(api_key="k") as served:
            assert_error(await served.client.get("/metrics"), 401)
            samples = await scrape(served, headers={"Authorization": "Bearer k"})
            assert value(
                samples, "mlx_pinned_requests_total", route="/metrics", status="401"
            )


async def test_route_labels_are_the_apps_routes(serve: Serve) -> None:
    async with serve() as served:
        route_of = served.app.state.metrics.route_of
        assert route_of(CHAT) == CHAT
        assert route_of("/v1/embeddings") == "/v1/embeddings"
        assert route_of("/v2/rerank") == "/v2/rerank"
        assert route_of("/v1/models/anything/at/all") == "/v1/models/{model_id}"
        assert route_of("/v1/responses/r1/input_items") == (
            "/v1/responses/{response_id}/input_items"
        )
        assert route_of("/" + "x" * 1000) == "other"
