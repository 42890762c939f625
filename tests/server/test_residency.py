"""Models loaded on first use: shared loads, failed loads, idle unloads,
the memory budget, and requests that race an unload; real tiny models,
through HTTP."""

from __future__ import annotations

import gc
import logging
import shutil
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import mlx.core as mx
import pytest
from conftest import LifespanFailed
from prometheus_client.parser import text_string_to_metric_families

import mlx_pinned.server.app as server_app
from mlx_pinned.server import ServerConfig, cli, create_app
from mlx_pinned.server.engine import BatchEngine, memory
from mlx_pinned.server.http.served_models import ModelSlot, SlotState
from mlx_pinned.testing import make_tiny_lm, make_tiny_vlm

from .conftest import assert_error, replace_generation, until
from .kit import Lifespan, SlowModel, in_process, logprobs

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-5
WAIT = 20  # seconds before a test that waits for a state fails instead of hanging


@pytest.fixture(scope="session")
def second_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("lazy") / "vlm-seed-1", seed=1)


@pytest.fixture(scope="session")
def text_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("lazy") / "lm")


class Lazy:
    """An app serving models loaded on first use, its lifespan running."""

    def __init__(self, app: Any, client: httpx.AsyncClient, state: Any) -> None:
        self.app = app
        self.client = client
        self.state = state

    def slot(self, name: str) -> ModelSlot:
        slot: ModelSlot | None = self.app.state.models.get(name).slot
        assert slot is not None
        return slot

    async def chat(self, name: str, max_tokens: int = 4, **fields: Any) -> Any:
        body = {
            "model": name,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            **fields,
        }
        return await self.client.post("/v1/chat/completions", json=body)

    async def health(self) -> dict[str, Any]:
        response = await self.client.get("/health")
        assert response.status_code == 200, response.text
        models: dict[str, Any] = response.json()["models"]
        return models

    async def metrics(self) -> dict[tuple[str, str], float]:
        text = (await self.client.get("/metrics")).text
        return {
            (sample.name, sample.labels.get("model", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


Serve = Callable[..., AbstractAsyncContextManager[Lazy]]


@pytest.fixture
def serve(
    tiny_model_path: Path, second_path: Path, text_path: Path, lifespan: Lifespan
) -> Serve:
    paths = {"a": tiny_model_path, "b": second_path, "c": text_path}

    @asynccontextmanager
    async def serve(
        names: tuple[str, ...] = ("a", "b"),
        paths_given: dict[str, Path] | None = None,
        **options: Any,
    ) -> AsyncIterator[Lazy]:
        options.setdefault("max_num_seqs", 2)
        options.setdefault("load_on_first_use", True)
        where = {**paths, **(paths_given or {})}
        app = create_app(
            [where[name] for name in names], served_model_name=names, **options
        )
        async with in_process(app, lifespan, Lazy) as served:
            yield served

    return serve


class CountedLoads:
    """Counts ``BatchEngine.load`` calls; while :attr:`hold` is clear, each
    load waits for it on the MLX thread (so requests can pile up)."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold = threading.Event()
        self.hold.set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        load = BatchEngine.load

        def counted(*args: Any, **kwargs: Any) -> BatchEngine:
            self.calls += 1
            assert self.hold.wait(WAIT)
            return load(*args, **kwargs)

        monkeypatch.setattr(BatchEngine, "load", counted)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> CountedLoads:
    counted = CountedLoads()
    counted.install(monkeypatch)
    return counted


class TestSettings:
    def test_idle_unload_needs_load_on_first_use(self) -> None:
        with pytest.raises(ValueError, match="needs load_on_first_use"):
            ServerConfig(model="m", idle_unload_timeout=5)
        for bad in (0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="idle_unload_timeout"):
                ServerConfig(model="m", load_on_first_use=True, idle_unload_timeout=bad)
        with pytest.raises(ValueError, match="max_model_bytes"):
            ServerConfig(model="m", max_model_bytes=0)

    def test_the_flags_reach_the_config(self) -> None:
        parser = cli.build_parser()
        argv = ["serve", "m", "--load-on-first-use", "--idle-unload-timeout", "30"]
        args = parser.parse_args([*argv, "--max-model-bytes", "1000"])
        config = cli._config(args)
        assert config.load_on_first_use
        assert config.idle_unload_timeout == 30.0
        assert config.max_model_bytes == 1000
        args = parser.parse_args([*argv[:-1], "0"])  # 0: never
        assert cli._config(args).idle_unload_timeout is None

    def test_idle_unload_without_first_use_is_a_usage_error(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "org/m", "--idle-unload-timeout", "5"])
        assert info.value.code == 2
        assert "--idle-unload-timeout needs --load-on-first-use" in (
            capsys.readouterr().err
        )


class TestFirstUse:
    async def test_the_first_request_loads_the_model_and_answers_as_at_start_up(
        self, serve: Serve, tiny_model_path: Path
    ) -> None:
        async with serve(load_on_first_use=False, names=("a",)) as eager:
            expected = logprobs(await eager.chat("a"))
        async with serve() as served:
            assert served.slot("a").state is SlotState.UNLOADED
            assert await served.health() == {
                name: {
                    "loaded": False,
                    "rows": 0,
                    "kv_bytes": 0,
                    "kv_bytes_per_token": 0,
                }
                for name in "ab"
            }
            listed = (await served.client.get("/v1/models")).json()["data"]
            assert [card["id"] for card in listed] == ["a", "b"]
            numbers = await served.metrics()
            assert numbers["mlx_pinned_model_loaded", "a"] == 0
            first = logprobs(await served.chat("a"))
            assert max(abs(x - y) for x, y in zip(first, expected, strict=True)) <= (
                TOLERANCE
            )
            health = await served.health()
            assert health["a"]["loaded"]
            assert not health["b"]["loaded"]  # only the model asked for loads
            numbers = await served.metrics()
            assert numbers["mlx_pinned_model_loaded", "a"] == 1
            assert numbers["mlx_pinned_model_loaded", "b"] == 0
            assert numbers["mlx_pinned_model_loads_total", "a"] == 1
            weights = numbers["mlx_pinned_model_weight_bytes", "a"]
            assert weights == served.slot("a").weight_bytes
            assert weights > 0
            assert not served.slot("a").at_start_up  # not loaded at start-up

    async def test_concurrent_first_requests_share_one_load(
        self, serve: Serve, loads: CountedLoads
    ) -> None:
        loads.hold.clear()
        statuses: list[int] = []
        async with serve(max_num_seqs=4) as served:
            slot = served.slot("a")

            async def one() -> None:
                statuses.append((await served.chat("a")).status_code)

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    for _ in range(4):
                        group.start_soon(one)
                    await until(lambda: slot.holders == 4)
                    assert slot.state is SlotState.LOADING
                    loads.hold.set()
        assert statuses == [200] * 4
        assert loads.calls == 1
        assert slot.loads == 1

    async def test_an_unknown_model_is_a_404_and_loads_nothing(
        self, serve: Serve, loads: CountedLoads
    ) -> None:
        async with serve() as served:
            error = assert_error(await served.chat("zz"), 404, "model")
            assert "'a', 'b'" in error["message"]
        assert loads.calls == 0

    async def test_a_failed_load_answers_its_waiters_and_a_later_one_retries(
        self,
        serve: Serve,
        tiny_model_path: Path,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        empty = tmp_path / "not-yet"
        empty.mkdir()
        async with serve(paths_given={"a": empty}) as served:
            slot = served.slot("a")
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    answers: list[httpx.Response] = []

                    async def one() -> None:
                        answers.append(await served.chat("a"))

                    for _ in range(2):
                        group.start_soon(one)
            for answer in answers:
                error = assert_error(answer, 503, None, "model_load_failed")
                assert "'a'" in error["message"]
                assert answer.headers["Retry-After"] == "1"
            assert slot.failures == 1  # one load, both waited for it
            assert slot.state is SlotState.UNLOADED
            assert "loading model 'a' failed" in caplog.text
            # The other model is unaffected, and the next request retries.
            assert (await served.chat("b")).status_code == 200
            shutil.copytree(tiny_model_path, empty, dirs_exist_ok=True)
            assert (await served.chat("a")).status_code == 200
            assert (slot.loads, slot.failures) == (1, 1)
            numbers = await served.metrics()
            assert numbers["mlx_pinned_model_load_failures_total", "a"] == 1

    async def test_a_client_that_leaves_does_not_cancel_the_load(
        self, serve: Serve, loads: CountedLoads
    ) -> None:
        loads.hold.clear()
        async with serve() as served:
            slot = served.slot("a")
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(served.chat, "a")
                    await until(lambda: loads.calls == 1)  # it loads, held
                    group.cancel_scope.cancel()  # the client leaves
            assert slot.holders == 0  # it left while the load went on
            assert slot.state is SlotState.LOADING
            loads.hold.set()
            with anyio.fail_after(WAIT):
                await until(lambda: slot.state is SlotState.LOADED)
            assert (await served.chat("a")).status_code == 200
        assert loads.calls == 1


@pytest.mark.slow
class TestIdleUnload:
    async def test_an_idle_model_is_unloaded_and_its_memory_given_back(
        self, serve: Serve
    ) -> None:
        async with serve(idle_unload_timeout=0.1) as served:
            slot = served.slot("a")
            first = logprobs(await served.chat("a"))
            assert slot.engine is not None
            read = slot.engine.facts  # type: ignore[attr-defined]
            model = weakref.ref(slot.engine.loaded)  # type: ignore[attr-defined]
            weights = slot.weight_bytes
            assert weights is not None
            gc.collect()
            before = mx.get_active_memory()
            with anyio.fail_after(WAIT):
                await until(lambda: slot.unloads == 1)
            assert slot.state is SlotState.UNLOADED
            assert slot.engine is None
            assert model() is None  # nothing kept the model alive
            assert before - mx.get_active_memory() >= weights
            assert mx.get_cache_memory() == 0  # given back, not kept cached
            assert not (await served.health())["a"]["loaded"]
            numbers = await served.metrics()
            assert numbers["mlx_pinned_model_loaded", "a"] == 0
            assert numbers["mlx_pinned_model_unloads_total", "a"] == 1
            # The next request loads it again, and it answers the same.
            again = logprobs(await served.chat("a"))
            assert again == first
            assert slot.loads == 2
            assert slot.engine.facts == read  # type: ignore[union-attr]
            assert slot.engine.facts is not read  # built again by the new load

    async def test_a_model_in_use_or_waited_for_is_not_unloaded(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        slow = SlowModel(step=0.005)
        replace_generation(monkeypatch, slow)
        async with serve(idle_unload_timeout=0.05, max_num_seqs=1) as served:
            slot, gate = served.slot("a"), served.app.state.models.get("a").gate
            assert (await served.chat("a")).status_code == 200  # idle now
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    for _ in range(2):  # one generating, one at the gate
                        group.start_soon(served.chat, "a", 4000)
                    await until(lambda: gate.active == 1 and gate.waiting == 1)
                    unloads = slot.unloads  # 1 if it went idle before they came
                    await anyio.sleep(0.3)  # several idle timeouts
                    assert slot.state is SlotState.LOADED
                    assert slot.unloads == unloads
                    slow.release.set()
                await until(lambda: slot.unloads == unloads + 1)  # idle at last

    async def test_a_request_during_the_unload_waits_for_the_reload(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        unloading, go_on = threading.Event(), threading.Event()
        release = memory.release

        def slow_release(holder: list[Any], name: str) -> Any:
            unloading.set()
            assert go_on.wait(WAIT)
            return release(holder, name)

        monkeypatch.setattr(server_app, "release", slow_release)  # create_app's
        async with serve(idle_unload_timeout=0.05) as served:
            slot = served.slot("a")
            first = logprobs(await served.chat("a"))
            with anyio.fail_after(WAIT):
                await until(unloading.is_set)
                assert slot.state is SlotState.UNLOADING
                async with anyio.create_task_group() as group:
                    answers: list[httpx.Response] = []

                    async def one() -> None:
                        answers.append(await served.chat("a"))

                    group.start_soon(one)
                    await until(lambda: slot.holders == 1)
                    go_on.set()
            assert logprobs(answers[0]) == first
            assert (slot.loads, slot.unloads) == (2, 1)


class TestBudget:
    @pytest.mark.slow
    async def test_a_load_past_the_budget_unloads_the_least_recently_used(
        self, serve: Serve
    ) -> None:
        async with serve(("a", "b", "c")) as probe:
            for name in "abc":
                assert (await probe.chat(name)).status_code == 200
            sizes = {name: probe.slot(name).weight_bytes or 0 for name in "abc"}
        # Room for the two vision models, or one of them and the text model.
        budget = sizes["a"] + sizes["b"] + sizes["c"] // 2
        async with serve(("a", "b", "c"), max_model_bytes=budget) as served:
            for name in "aba":  # b is now the least recently used
                assert (await served.chat(name)).status_code == 200
            assert (await served.chat("c")).status_code == 200
            states = {name: served.slot(name).state for name in "abc"}
            assert states == {
                "a": SlotState.LOADED,
                "b": SlotState.UNLOADED,
                "c": SlotState.LOADED,
            }
            health = await served.health()
            assert [health[name]["loaded"] for name in "abc"] == [True, False, True]
            assert served.app.state.residency.weight_bytes() <= budget

    @pytest.mark.slow
    async def test_no_room_next_to_a_model_in_use_is_a_503(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with serve(("a",)) as probe:
            assert (await probe.chat("a")).status_code == 200
            size = probe.slot("a").weight_bytes or 0
        slow = SlowModel(step=0.005)
        replace_generation(monkeypatch, slow)
        async with serve(max_model_bytes=size * 3 // 2) as served:
            gate = served.app.state.models.get("a").gate
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(served.chat, "a", 4000)
                    await until(lambda: gate.active == 1)
                    refused = await served.chat("b")
                    error = assert_error(refused, 503, None, "model_memory_budget")
                    assert "retry shortly" in error["message"]
                    assert refused.headers["Retry-After"] == "1"
                    assert served.slot("a").state is SlotState.LOADED  # kept
                    slow.release.set()
            # Once a is idle, b takes its place.
            assert (await served.chat("b")).status_code == 200
            assert served.slot("a").state is SlotState.UNLOADED

    async def test_a_model_larger_than_the_budget_never_loads(
        self, serve: Serve, loads: CountedLoads
    ) -> None:
        async with serve(max_model_bytes=1000) as served:
            refused = await served.chat("a")
            error = assert_error(refused, 503, None, "model_memory_budget")
            assert "never fits" in error["message"]
            assert "Retry-After" not in refused.headers
        assert loads.calls == 0

    async def test_start_up_models_past_the_budget_fail_the_start_up(
        self, serve: Serve, loads: CountedLoads, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.ERROR)
        with pytest.raises(LifespanFailed, match="more than max_model_bytes"):
            async with serve(load_on_first_use=False, max_model_bytes=1000):
                pass  # pragma: no cover
        assert loads.calls == 0  # refused before any load
