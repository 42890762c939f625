"""Several models in one server: routing by ``model``, ``/v1/models``, a gate
and a batch per model on the one MLX thread, and their metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_pinned.server import ServerConfig, create_app
from mlx_pinned.server.engine import BatchEngine
from mlx_pinned.server.engine.loop import BatchLoop
from mlx_pinned.testing import make_tiny_vlm

from .conftest import assert_error, replace_generation, sse_events, until, vision_body
from .kit import Lifespan, SlowModel, in_process, logprobs

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-5  # float32 rounding; another model's answer differs by far more
NAMES = ("first", "second")


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model: the same family, other random weights."""
    return make_tiny_vlm(tmp_path_factory.mktemp("models") / "seed-1", seed=1)


class TwoServed:
    """An app serving the two tiny models, its lifespan running."""

    def __init__(
        self, app: Any, client: httpx.AsyncClient, state: dict[str, Any]
    ) -> None:
        self.app = app
        self.client = client
        self.state = state

    def engine(self, name: str) -> BatchEngine:
        engine = self.app.state.models.get(name).engine()
        assert isinstance(engine, BatchEngine)
        return engine

    async def chat(self, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=body)


ServeModels = Callable[..., AbstractAsyncContextManager[TwoServed]]


@pytest.fixture
def serve_models(
    tiny_model_path: Path, other_model_path: Path, lifespan: Lifespan
) -> ServeModels:
    @asynccontextmanager
    async def serve(
        paths: tuple[Path, ...] = (tiny_model_path, other_model_path),
        names: tuple[str, ...] = NAMES,
        **options: Any,
    ) -> AsyncIterator[TwoServed]:
        options.setdefault("max_num_seqs", 1)
        app = create_app(paths, served_model_name=names, **options)
        async with in_process(app, lifespan, TwoServed) as served:
            yield served

    return serve


def body(
    name: str, index: int = 0, max_tokens: int = 8, **fields: Any
) -> dict[str, Any]:
    size = 32 + 16 * (index % 3)
    fields.setdefault("logprobs", True)
    return vision_body(
        max_tokens,
        model=name,
        image_seed=index,
        image_size=(size, size),
        prompt=f"Describe picture {index}.",
        **fields,
    )


def worst(one: list[float], other: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(one, other, strict=True))


async def alone(
    serve_models: ServeModels, path: Path, bodies: list[dict[str, Any]]
) -> list[list[float]]:
    """Each body's logprobs from a server of ``path`` alone, one at a time."""
    name = bodies[0]["model"]
    async with serve_models((path,), (name,)) as served:
        return [logprobs(await served.chat(b)) for b in bodies]


class TestConfig:
    def test_one_model_is_a_string_however_given(self) -> None:
        assert ServerConfig(model=("m",)) == ServerConfig(model="m")
        assert ServerConfig(model=("m",), served_model_name=("n",)).name == "n"

    def test_several_models_and_their_names(self) -> None:
        config = ServerConfig(model=("a", "b"), served_model_name=("x", "y"))
        assert config.models == ("a", "b")
        assert config.names == ("x", "y")
        assert config.name == "x"
        unnamed = ServerConfig(model=("a", "b"))
        assert unnamed.names == ("a", "b")
        # Each model's waiting room and batch reach the MLX thread's queue.
        one = ServerConfig(model="a")
        assert config.thread_bound == 2 * one.thread_bound

    @pytest.mark.parametrize(
        ("settings", "text"),
        [
            ({"model": ("a", "b"), "served_model_name": "x"}, "1 names for 2"),
            ({"model": "a", "served_model_name": ("x", "y")}, "2 names for 1"),
            ({"model": ("a", "a")}, "served as 'a'"),
            ({"model": ("a", "b"), "served_model_name": ("x", "x")}, "'x'"),
            ({"model": ()}, "model is empty"),
            ({"model": ("a", 1)}, "a string or a sequence"),
        ],
    )
    def test_bad_models_are_value_errors(
        self, settings: dict[str, Any], text: str
    ) -> None:
        with pytest.raises(ValueError, match=text):
            ServerConfig(**settings)

    def test_the_default_cache_budgets_are_shared_out(self) -> None:
        one, two = ServerConfig(model="a"), ServerConfig(model=("a", "b"))
        assert two.prompt_cache_budget == one.prompt_cache_budget // 2
        assert two.image_cache_budget == one.image_cache_budget // 2
        given = dataclasses.replace(two, prompt_cache_bytes=100)
        assert given.prompt_cache_budget == 100  # a given budget is per model


class TestRouting:
    async def test_each_name_answers_with_its_own_model(
        self, serve_models: ServeModels, tiny_model_path: Path, other_model_path: Path
    ) -> None:
        first = [body("first", i) for i in range(2)]
        second = [body("second", i) for i in range(2)]
        solo_first = await alone(serve_models, tiny_model_path, first)
        solo_second = await alone(serve_models, other_model_path, second)
        async with serve_models() as served:
            for request, expected in zip(first, solo_first, strict=True):
                response = await served.chat(request)
                assert response.json()["model"] == "first"
                assert worst(logprobs(response), expected) <= TOLERANCE
            for request, expected in zip(second, solo_second, strict=True):
                response = await served.chat(request)
                assert response.json()["model"] == "second"
                assert worst(logprobs(response), expected) <= TOLERANCE
        # The two models differ, so the routing is what was checked.
        assert worst(solo_first[0], solo_second[0]) > 0.01

    async def test_a_stream_names_its_model(self, serve_models: ServeModels) -> None:
        async with serve_models() as served:
            response = await served.chat(body("second", stream=True))
            assert response.status_code == 200
            chunks = sse_events(response.text)
            assert chunks[-1] == "[DONE]"
            assert {chunk["model"] for chunk in chunks[:-1]} == {"second"}

    async def test_an_unknown_model_is_a_404_naming_the_served_ones(
        self, serve_models: ServeModels
    ) -> None:
        async with serve_models() as served:
            error = assert_error(
                await served.chat(body("gpt-4o")), 404, "model", "model_not_found"
            )
            assert "'gpt-4o'" in error["message"]
            assert "'first', 'second'" in error["message"]
            missing = await served.client.get("/v1/models/gpt-4o")
            error = assert_error(missing, 404, "model", "model_not_found")
            assert "'first', 'second'" in error["message"]

    async def test_models_lists_every_model_in_order(
        self, serve_models: ServeModels
    ) -> None:
        async with serve_models() as served:
            listing = (await served.client.get("/v1/models")).json()
            assert [m["id"] for m in listing["data"]] == list(NAMES)
            for name, entry in zip(NAMES, listing["data"], strict=True):
                card = (await served.client.get(f"/v1/models/{name}")).json()
                assert card == entry
                assert card["created"] == int(served.engine(name).loaded_at)

    async def test_each_model_is_loaded_at_start_up_with_its_own_engine(
        self, serve_models: ServeModels
    ) -> None:
        async with serve_models() as served:
            first, second = served.engine("first"), served.engine("second")
            slots = [model.slot for model in served.app.state.models]
            assert [(slot.at_start_up, slot.loads) for slot in slots] == [(True, 1)] * 2
            assert first is not second
            assert first.thread is second.thread is served.app.state.mlx_thread
            assert (await served.client.get("/health")).status_code == 200


class TestConcurrency:
    @pytest.mark.slow
    async def test_both_batches_run_at_once_and_match_their_solo_runs(
        self,
        serve_models: ServeModels,
        tiny_model_path: Path,
        other_model_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        lengths = [24, 14, 20, 10]
        bodies = {
            name: [body(name, i, n) for i, n in enumerate(lengths)] for name in NAMES
        }
        solo = {
            "first": await alone(serve_models, tiny_model_path, bodies["first"]),
            "second": await alone(serve_models, other_model_path, bodies["second"]),
        }
        together: dict[tuple[str, int], list[float]] = {}
        # Each model's rows, read on the MLX thread at every turn of a loop.
        rows: list[list[int]] = []
        turn = BatchLoop.turn

        def watched(loop: BatchLoop) -> Any:
            rows.append([e.statistics().active for e in engines])
            return turn(loop)

        monkeypatch.setattr(BatchLoop, "turn", watched)
        async with serve_models(max_num_seqs=4) as served:
            engines = [served.engine(name) for name in NAMES]

            async def one(name: str, index: int) -> None:
                response = await served.chat(bodies[name][index])
                together[name, index] = logprobs(response)

            async with anyio.create_task_group() as group:
                for name in NAMES:
                    for index in range(len(lengths)):
                        group.start_soon(one, name, index)
            stats = served.app.state.mlx_thread.statistics()
        both_batched = any(min(at) >= 2 for at in rows)
        for name in NAMES:
            for index, expected in enumerate(solo[name]):
                assert worst(together[name, index], expected) <= TOLERANCE
        assert both_batched  # each model had a batch of several rows at once
        assert stats.failed == 0
        assert stats.open_streams == 0

    async def test_a_full_model_does_not_hold_up_the_other(
        self, serve_models: ServeModels, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        slow = SlowModel(step=0.01)
        replace_generation(monkeypatch, slow)
        async with serve_models(max_num_seqs=1, max_pending=1) as served:
            first = served.app.state.models.get("first").gate
            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    for _ in range(2):
                        group.start_soon(served.chat, body("first", max_tokens=4000))
                    await until(lambda: first.busy and first.waiting == 1)
                    # The first model's one slot is taken and its room is
                    # full: it refuses; the second has its own gate.
                    busy = await served.chat(body("first", max_tokens=2))
                    assert_error(busy, 503, None, "server_busy")
                    other = await served.chat(body("second", max_tokens=2))
                    assert other.status_code == 200, other.text
                    slow.release.set()


class TestMetrics:
    async def test_per_model_numbers_carry_a_model_label(
        self, serve_models: ServeModels
    ) -> None:
        async with serve_models(prompt_cache_bytes=2**24) as served:
            assert (await served.chat(body("first", max_tokens=3))).status_code == 200
            assert (await served.chat(body("second", max_tokens=5))).status_code == 200
            assert_error(await served.chat(body("nobody")), 404, "model")
            text = (await served.client.get("/metrics")).text
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

        def value(metric: str, **labels: str) -> float:
            return samples[f"mlx_pinned_{metric}", tuple(sorted(labels.items()))]

        chat = "chat_completions"
        assert value("generated_tokens_total", model="first", api=chat) == 3
        assert value("generated_tokens_total", model="second", api=chat) == 5
        assert value("time_to_first_token_seconds_count", model="second", api=chat) == 1
        for metric in (
            "queue_depth",
            "active_generations",
            "batch_rows",
            "kv_cache_bytes",
            "prompt_cache_bytes",
            "prompt_cache_misses_total",
        ):
            assert value(metric, model="first") >= 0
            assert value(metric, model="second") >= 0
        assert value("prompt_cache_misses_total", model="second") == 1
        # Requests by route and the MLX thread are the server's, unlabelled.
        chat = {"route": "/v1/chat/completions"}
        assert value("requests_total", **chat, status="404") == 1
        assert value("mlx_thread_up") == 1
        # A name no model has is no label: it would grow without bound.
        assert not any(("model", "nobody") in labels for _, labels in samples)
