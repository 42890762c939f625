"""Models loaded, kept and unloaded by API: Ollama's ``keep_alive`` and its
requests with no turn, ``POST /v1/models/{id}/load`` and ``/unload`` (which
drain the requests in flight), the ``pinned`` setting, and what
``/api/ps`` and ``/v1/models`` say of each model."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import mlx.core as mx
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.server.http.served_models import ModelSlot, SlotState
from mlx_pinned.testing import tiny_vlm_path

from .conftest import drive, sse_events, until
from .kit import TOL, WAIT, Lifespan, Served, in_process

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Tell me a story."}]


class Lifecycle(Served):
    def slot(self, name: str) -> ModelSlot:
        slot: ModelSlot = self.app.state.models.get(name).slot
        return slot

    async def ollama(self, name: str, **fields: Any) -> httpx.Response:
        body = {"model": name, "stream": False, **fields}
        return await self.client.post("/api/chat", content=json.dumps(body).encode())

    async def ps(self) -> list[str]:
        answer = await self.client.get("/api/ps")
        return [model["name"] for model in answer.json()["models"]]

    async def card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = (await self.client.get(f"/v1/models/{name}")).json()
        return card


@pytest.fixture
def serve(lifespan: Lifespan) -> Any:
    @asynccontextmanager
    async def serve(*own: dict[str, Any], **options: Any) -> AsyncIterator[Lifecycle]:
        names = ("a", "b")[: len(own)]
        app = create_app(
            [str(tiny_vlm_path())] * len(own),
            served_model_name=names,
            model_settings=own,
            **options,
        )
        async with in_process(app, lifespan, Lifecycle) as served:
            yield served

    return serve


FIRST_USE: dict[str, Any] = {"load_on_first_use": True}
ANSWER = {"messages": USER, "options": {"temperature": 0, "num_predict": 4}}


async def test_keep_alive_0_unloads_after_the_answer(serve: Any) -> None:
    async with serve({}) as served:
        slot = served.slot("a")
        weights = slot.weight_bytes
        assert weights
        assert await served.ps() == ["a:latest"]
        gc.collect()
        before = mx.get_active_memory()
        answer = await served.ollama("a", keep_alive=0, **ANSWER)
        assert answer.status_code == 200
        with anyio.fail_after(WAIT):
            await until(lambda: slot.unloads == 1)
        assert await served.ps() == []
        gc.collect()
        assert before - mx.get_active_memory() >= weights
        assert (await served.card("a"))["state"] == "unloaded"
        # The next request loads it again (a model loaded at start-up too).
        again = await served.ollama("a", **ANSWER)
        assert again.json()["message"] == answer.json()["message"]
        assert slot.loads == 2


async def test_keep_alive_minus_1_survives_the_idle_timeout(serve: Any) -> None:
    async with serve(FIRST_USE, FIRST_USE, idle_unload_timeout=0.2) as served:
        kept, other = served.slot("a"), served.slot("b")
        assert (await served.ollama("a", keep_alive=-1, **ANSWER)).status_code == 200
        assert (await served.ollama("b", **ANSWER)).status_code == 200
        # b, idle as long as a, goes after its timeout; a stays.
        with anyio.fail_after(WAIT):
            await until(lambda: other.unloads == 1)
        assert kept.state is SlotState.LOADED
        assert await served.ps() == ["a:latest"]
        assert (await served.card("a"))["expires_at"] is None
        # A later keep_alive replaces it: "1s" from now on.
        assert (await served.ollama("a", keep_alive="1s", **ANSWER)).status_code == 200
        expires = (await served.card("a"))["expires_at"]
        assert expires is not None
        with anyio.fail_after(WAIT):
            await until(lambda: kept.unloads == 1)


async def test_a_pinned_model_survives_the_budget_and_keep_alive(serve: Any) -> None:
    pinned = {**FIRST_USE, "pinned": True}
    async with serve(FIRST_USE) as probe:
        await probe.ollama("a", **ANSWER)
        weights = probe.slot("a").weight_bytes
    assert weights
    budget = weights + weights // 2  # room for one model
    async with serve(pinned, FIRST_USE, max_model_bytes=budget) as served:
        assert (await served.ollama("a", keep_alive=0, **ANSWER)).status_code == 200
        refused = await served.ollama("b", **ANSWER)
        assert refused.status_code == 503
        assert "pinned" in refused.json()["error"]
        assert served.slot("a").state is SlotState.LOADED
        assert served.slot("a").unloads == 0
        assert (await served.card("a"))["pinned"] is True
        # Only an unload by API unloads it.
        unloaded = await served.client.post("/v1/models/a/unload")
        assert unloaded.json()["state"] == "unloaded"
        assert (await served.ollama("b", **ANSWER)).status_code == 200
    async with serve(FIRST_USE, FIRST_USE, max_model_bytes=budget) as control:
        await control.ollama("a", **ANSWER)
        assert (await control.ollama("b", **ANSWER)).status_code == 200
        assert control.slot("a").state is SlotState.UNLOADED  # made room


async def test_requests_with_no_turn_load_and_unload(serve: Any) -> None:
    async with serve(FIRST_USE) as served:
        assert await served.ps() == []
        loaded = await served.ollama("a", messages=[])
        assert loaded.json()["done_reason"] == "load"
        assert await served.ps() == ["a:latest"]
        generate = {"model": "a", "keep_alive": 0, "stream": False}
        unloaded = await served.client.post("/api/generate", json=generate)
        assert unloaded.json()["done_reason"] == "unload"
        assert unloaded.json()["response"] == ""
        assert await served.ps() == []
        card = await served.card("a")
        assert card["state"] == "unloaded"
        assert card["weight_bytes"] is None


async def test_load_and_unload_by_api_with_the_api_key(serve: Any) -> None:
    async with serve(FIRST_USE, api_key="secret") as served:
        headers = {"authorization": "Bearer secret"}
        refused = await served.client.post("/v1/models/a/load")
        assert refused.status_code == 401
        assert served.slot("a").state is SlotState.UNLOADED
        loaded = await served.client.post("/v1/models/a/load", headers=headers)
        card = loaded.json()
        assert card["state"] == "loaded"
        assert card["weight_bytes"] == served.slot("a").weight_bytes > 0
        assert card["expires_at"] is None  # no idle timeout
        unknown = await served.client.post("/v1/models/z/unload", headers=headers)
        assert unknown.status_code == 404


async def test_an_unload_drains_the_requests_in_flight(serve: Any) -> None:
    body = {"model": "a", "messages": USER, "max_tokens": 24, "stream": True}
    async with serve({}, stream_write_interval=0) as served:
        slot = served.slot("a")
        hold, started = anyio.Event(), anyio.Event()
        results: list[Any] = []
        unloaded: list[httpx.Response] = []
        waited: list[httpx.Response] = []

        async def stream() -> None:
            results.append(await drive(served.app, body, hold=hold, started=started))

        async def unload() -> None:
            unloaded.append(await served.client.post("/v1/models/a/unload"))

        async def arrive() -> None:
            waited.append(await served.ollama("a", **ANSWER))

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(stream)
                await started.wait()
                tasks.start_soon(unload)
                await until(lambda: slot.state is SlotState.DRAINING)
                tasks.start_soon(arrive)
                await until(lambda: slot.holders == 2)
                # The stream still runs: the unload waits for it.
                assert slot.state is SlotState.DRAINING
                assert not unloaded
                hold.set()
        ((status, sent),) = results
        events = sse_events(b"".join(sent).decode())
        assert status == 200
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert unloaded[0].json()["id"] == "a"
        # The request that came during the drain loaded the model again.
        assert waited[0].status_code == 200
        assert (slot.loads, slot.unloads) == (2, 1)


async def test_load_and_unload_by_api_beside_8_streams(serve: Any) -> None:
    def body(index: int) -> dict[str, Any]:
        words = f"Tell me story number {index}."
        return {
            "model": "a",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": 16,
            "temperature": 0.0,
            "logprobs": True,
        }

    async with serve({}, FIRST_USE, max_num_seqs=8) as served:
        alone = [
            (await served.chat(body(index))).json()["choices"][0] for index in range(8)
        ]
        hold = anyio.Event()
        starts = [anyio.Event() for _ in range(8)]
        results: dict[int, Any] = {}

        async def stream(index: int) -> None:
            results[index] = await drive(
                served.app,
                {**body(index), "stream": True},
                hold=hold,
                started=starts[index],
            )

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tasks:
                for index in range(8):
                    tasks.start_soon(stream, index)
                for started in starts:
                    await started.wait()
                client = served.client
                loaded = await client.post("/v1/models/b/load")
                answered = await served.ollama("b", **ANSWER)
                unloaded = await client.post("/v1/models/b/unload")
                again = await served.ollama("b", messages=[])
                gone = await served.ollama("b", messages=[], keep_alive=0)
                hold.set()
        assert loaded.json()["state"] == "loaded"
        assert answered.status_code == 200
        assert unloaded.json()["state"] == "unloaded"
        assert again.json()["done_reason"] == "load"
        assert gone.json()["done_reason"] == "unload"
        assert (served.slot("b").loads, served.slot("b").unloads) == (2, 2)
    for index, (status, sent) in results.items():
        assert status == 200
        chunks = [e for e in sse_events(b"".join(sent).decode()) if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        streamed = [
            entry["logprob"]
            for c in chunks
            for entry in (c["choices"][0].get("logprobs") or {}).get("content") or []
        ]
        reference = alone[index]
        assert text == reference["message"]["content"]
        expected = [entry["logprob"] for entry in reference["logprobs"]["content"]]
        assert len(streamed) == len(expected) == 16
        assert max(abs(x - y) for x, y in zip(streamed, expected, strict=True)) <= TOL
