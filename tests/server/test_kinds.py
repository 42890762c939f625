"""A sixth kind is one folder: the toy ``echo`` kind below (its values, an
engine on the MLX thread and a door) is registered from this file, served
beside the real kinds through ``create_app`` with no edit under
``mlx_pinned/server/``, and gets every door's behaviour."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import create_app
from mlx_pinned.server.config import ModelSettings
from mlx_pinned.server.http.door import Call, Door, routes
from mlx_pinned.server.http.errors import APIError, OpenAIErrors
from mlx_pinned.server.kinds import KINDS, Kind, kind_named, register
from mlx_pinned.server.resident import EngineCounters, Resident

from .conftest import until
from .kit import Lifespan, Served, in_process

pytestmark = pytest.mark.anyio


# -- values: any thread ---------------------------------------------------


@dataclass(frozen=True)
class EchoFacts:
    longest: int  # characters an echo may have

    def card(self) -> dict[str, Any]:
        return {"longest_echo": self.longest}


@runtime_checkable
class EchoEngine(Resident, Protocol):
    @property
    def facts(self) -> EchoFacts: ...

    async def echo(self, text: str) -> str: ...


# -- engine: the MLX thread -----------------------------------------------


@dataclass(eq=False)
class MLXEcho:
    thread: MLXThread
    weights: mx.array
    facts: EchoFacts
    loaded_at: float = field(default_factory=time.time)

    @classmethod
    def load(cls, settings: ModelSettings, thread: MLXThread) -> MLXEcho:
        weights = mx.load(str(Path(settings.path) / "echo.safetensors"))["w"]
        mx.eval(weights)
        return cls(thread, weights, EchoFacts(weights.size))

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def counters(self) -> EngineCounters:
        return EngineCounters(0, 0, 0, 0, 0, 0)

    async def echo(self, text: str) -> str:
        return await self.thread.run(self._reversed, text)

    def _reversed(self, text: str) -> str:
        codes = mx.array([ord(c) for c in text])[::-1] + self.weights[: len(text)]
        return "".join(chr(code) for code in codes.tolist())


# -- door: the event loop -------------------------------------------------


class EchoErrors(OpenAIErrors):
    """The echo API's own error shape."""

    def body(self, error: APIError) -> bytes:
        return json.dumps({"echo_error": error.message, "at": error.param}).encode()


@dataclass(frozen=True)
class EchoRequest:
    model: str
    text: str


class EchoDoor(Door[EchoRequest, EchoEngine, str, str]):
    route = "POST /v1/echo"
    kind = "echo"
    errors = EchoErrors()
    prompt = "text"
    api = "echo"

    async def parse(self, body: bytes, places: list[str]) -> EchoRequest:
        fields = json.loads(body)
        if not isinstance(fields.get("text"), str):
            raise APIError(400, "Send a 'text'.", param="text")
        return EchoRequest(str(fields.get("model")), fields["text"])

    async def prepare(self, request: EchoRequest, engine: EchoEngine) -> str:
        if len(request.text) > engine.facts.longest:
            raise APIError(400, "The text is too long to echo.", param="text")
        return request.text

    @asynccontextmanager
    async def run(self, call: Call[EchoRequest, EchoEngine, str]) -> AsyncIterator[str]:
        yield await call.engine.echo(call.prepared)

    async def send_whole(
        self, call: Call[EchoRequest, EchoEngine, str], output: str
    ) -> None:
        call.log.prompt_tokens = len(call.prepared)
        body = {"echo": output, "model": call.served.name}
        await call.response.json(json.dumps(body).encode())


ECHO = Kind(
    name="echo",
    what="an echo model",
    paths=("/v1/echo",),
    protocol=EchoEngine,
    load=MLXEcho.load,
    routes=lambda wiring: routes(EchoDoor(wiring)),
)


# -- the tests ------------------------------------------------------------


@pytest.fixture
def echo_kind() -> Iterator[Kind]:
    register(ECHO)
    try:
        yield ECHO
    finally:
        del KINDS["echo"]


@pytest.fixture
def echo_path(tmp_path: Path) -> Path:
    mx.save_safetensors(
        str(tmp_path / "echo.safetensors"), {"w": mx.zeros((16,), mx.int32)}
    )
    return tmp_path


@pytest.fixture
def serve(
    echo_kind: Kind, echo_path: Path, tiny_model_path: Path, lifespan: Lifespan
) -> Any:
    @asynccontextmanager
    async def serve(
        echo: dict[str, Any] | None = None, **options: Any
    ) -> AsyncIterator[Served]:
        own = {"model_kind": "echo", **(echo or {})}
        app = create_app(
            (tiny_model_path, echo_path),
            served_model_name=("chat", "echo"),
            model_settings=({}, own),
            **options,
        )
        async with in_process(app, lifespan, Served) as served:
            yield served

    return serve


async def echo(served: Served, text: str = "hello", **extra: Any) -> Any:
    return await served.client.post(
        "/v1/echo", json={"model": "echo", "text": text}, **extra
    )


async def test_the_kind_serves_and_is_listed(serve: Any) -> None:
    async with serve() as served:
        answer = await echo(served)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"echo": "olleh", "model": "echo"}
        card = (await served.client.get("/v1/models/echo")).json()
        assert (card["kind"], card["longest_echo"]) == ("echo", 16)
        listed = (await served.client.get("/v1/models")).json()["data"]
        assert [entry["id"] for entry in listed] == ["chat", "echo"]


async def test_its_refusals_come_in_its_own_shape(serve: Any) -> None:
    async with serve() as served:
        unknown = await served.client.post("/v1/echo", json={"model": "x", "text": "a"})
        assert unknown.status_code == 404
        assert unknown.json()["at"] == "model"
        chat = await served.client.post("/v1/echo", json={"model": "chat", "text": "a"})
        assert chat.status_code == 400
        assert "/v1/chat/completions" in chat.json()["echo_error"]
        long = await echo(served, "x" * 17)
        assert (long.status_code, long.json()["at"]) == (400, "text")
        # A model of the echo kind named on the chat door is sent to its own.
        body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        wrong = await served.chat(body)
        assert wrong.status_code == 400
        assert "/v1/echo" in wrong.json()["error"]["message"]


async def test_the_api_key_is_asked_in_its_shape(serve: Any) -> None:
    async with serve(api_key="k") as served:
        refused = await echo(served)
        assert refused.status_code == 401
        assert "API key" in refused.json()["echo_error"]
        allowed = await echo(served, headers={"Authorization": "Bearer k"})
        assert allowed.status_code == 200, allowed.text


async def test_a_full_gate_is_a_503_with_retry_after(serve: Any) -> None:
    async with serve(echo={"max_num_seqs": 1, "max_pending": 1}) as served:
        gate = served.app.state.models.get("echo").gate

        async def wait() -> None:
            async with gate.turn():
                pass

        async with anyio.create_task_group() as group:
            async with gate.turn():  # the one turn, held
                group.start_soon(wait)  # the one place in the waiting room
                await until(lambda: gate.waiting == 1)
                full = await echo(served)
        assert full.status_code == 503
        assert full.headers["retry-after"] == "1"
        assert "echo_error" in full.json()
        assert (await echo(served)).status_code == 200


async def test_the_deadline_is_a_504(serve: Any) -> None:
    async with serve(echo={"max_num_seqs": 1}, request_timeout=0.2) as served:
        gate = served.app.state.models.get("echo").gate
        async with gate.turn():  # the request waits for the gate past its deadline
            late = await echo(served)
        assert late.status_code == 504
        assert "echo_error" in late.json()


async def test_its_metrics(serve: Any) -> None:
    async with serve() as served:
        before = (await served.client.get("/metrics")).text
        assert 'mlx_pinned_prompt_tokens_total{api="echo",model="echo"} 0.0' in before
        assert (await echo(served, "four")).status_code == 200
        after = (await served.client.get("/metrics")).text
        assert 'mlx_pinned_requests_total{route="/v1/echo",status="200"} 1.0' in after
        assert 'mlx_pinned_prompt_tokens_total{api="echo",model="echo"} 4.0' in after
        assert 'mlx_pinned_model_loaded{model="echo"} 1.0' in after


async def test_it_loads_on_first_use_and_unloads_when_idle(serve: Any) -> None:
    lazy = {"load_on_first_use": True, "idle_unload_timeout": 0.05}
    async with serve(echo=lazy) as served:
        slot = served.app.state.models.get("echo").slot
        assert (slot.loads, slot.engine) == (0, None)
        assert (await echo(served)).status_code == 200
        assert slot.loads == 1
        with anyio.fail_after(30):  # unloaded once idle; a bound, not a timing
            await until(lambda: slot.unloads == 1)
        assert slot.engine is None
        assert (await echo(served)).status_code == 200
        assert slot.loads == 2


def test_a_kind_is_found_by_name_once_registered(echo_kind: Kind) -> None:
    assert kind_named("echo") is echo_kind
    with pytest.raises(ValueError, match="registered already"):
        register(echo_kind)
    assert echo_kind.honours("max_num_seqs")
    assert not echo_kind.honours("kv_bits")
