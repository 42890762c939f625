"""The CLI's uvicorn server: it answers probes while the model loads, and on
SIGTERM it turns readiness off for ``--unready-seconds`` before its listener
closes. Real ``mlx-pinned serve --demo`` subprocesses under real uvicorn."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.lifespan.on import LifespanOn

from mlx_pinned import MLXThread
from mlx_pinned.server import cli, create_app
from mlx_pinned.server.cli import DEMO_MODEL_NAME
from mlx_pinned.server.http import uvicorn_server
from mlx_pinned.server.http.uvicorn_server import Server
from mlx_pinned.testing import image_data_uri

from .replicas import replica

pytestmark = pytest.mark.timeout(120)


def chat_body(max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "Describe this image."},
        {"type": "image_url", "image_url": {"url": image_data_uri(64, 64)}},
    ]
    return {
        "model": DEMO_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **fields,
    }


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code


@pytest.mark.slow
def test_sigterm_turns_readiness_off_then_closes_the_listener(tmp_path: Path) -> None:
    # A window far longer than the test: it ends at the second signal, once
    # the window was seen, so no clock decides what the probes find.
    with replica(tmp_path / "a.log", "--unready-seconds", "600") as a:
        a.wait_ready()
        assert a.status("/health") == 200
        body = chat_body(max_tokens=800, stream=True)  # in flight at the signal
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", a.url + "/v1/chat/completions", json=body) as stream,
        ):
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            a.terminate()
            deadline = time.monotonic() + 60
            seen: dict[str, int] = {}
            while "served" not in seen:  # the window: not ready, alive, serving
                ready = httpx.get(a.url + "/health", timeout=5)
                alive = httpx.get(a.url + "/livez", timeout=5)
                if ready.status_code == 503:
                    assert error_code(ready) == "shutting_down"
                    assert alive.status_code == 200
                    seen["draining probes"] = seen.get("draining probes", 0) + 1
                    answer = client.post(
                        a.url + "/v1/chat/completions", json=chat_body()
                    )
                    seen["served"] = answer.status_code
                else:
                    assert time.monotonic() < deadline, "the signal was not handled"
                    time.sleep(0.05)
            assert httpx.get(a.url + "/health", timeout=5).status_code == 503
            a.terminate()  # a second signal ends the window
            while True:
                try:
                    httpx.get(a.url + "/health", timeout=5)
                except httpx.TransportError:
                    break  # the listener closed
                assert time.monotonic() < deadline, "the listener stayed open"
                time.sleep(0.05)
            rest = [line for line in lines if line]
        assert seen == {"draining probes": 1, "served": 200}  # served in the window
        assert rest[-1] == "data: [DONE]"  # the stream in flight finished
        assert a.process.wait(timeout=60) == 0
        log = a.log_text()
        assert "draining: /health answers 503 for 600.0 s" in log
        assert "Traceback" not in log
        assert " ERROR " not in log


@pytest.mark.slow
def test_alive_while_loading_and_a_sigterm_then_skips_the_window(
    tmp_path: Path,
) -> None:
    options = ("--unready-seconds", "60", "--load-wait", "0.5")
    with replica(tmp_path / "b.log", *options, gated=True) as b:
        # Loading: alive, not ready, and a request refused as not loaded
        # once it waited --load-wait for the load.
        assert b.status("/livez") == 200
        loading = httpx.get(b.url + "/health")
        assert loading.status_code == 503
        assert error_code(loading) == "model_not_loaded"
        sent = time.monotonic()
        early = httpx.post(b.url + "/v1/chat/completions", json=chat_body())
        assert time.monotonic() - sent >= 0.5
        assert early.status_code == 503
        assert error_code(early) == "model_not_loaded"
        assert early.headers["Retry-After"] == "1"
        assert b.status("/metrics") == 200
        # Never ready, so no balancer sends here: no reason to wait 60 s.
        b.terminate()
        deadline = time.monotonic() + 30
        while "Shutting down" not in b.log_text():  # at once, not in 60 s
            assert time.monotonic() < deadline, b.log_text()
            time.sleep(0.02)
        b.open_gate()  # the shut-down waits for the load, then stops
        assert b.process.wait(timeout=30) == 0
        log = b.log_text()
        assert "draining:" not in log
        assert "Uvicorn running on" not in log  # it never said it was ready


@pytest.mark.slow
def test_a_request_sent_while_the_model_loads_waits_for_it(tmp_path: Path) -> None:
    with replica(tmp_path / "c.log", gated=True) as c:
        answers: list[httpx.Response] = []

        def send() -> None:
            answers.append(
                httpx.post(c.url + "/v1/chat/completions", json=chat_body(), timeout=60)
            )

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.5)
        assert not answers  # waiting for the load, not refused
        assert c.status("/health") == 503  # balancers still see it loading
        c.open_gate()
        sender.join(timeout=60)
        assert len(answers) == 1
        assert answers[0].status_code == 200
        assert answers[0].json()["usage"]["completion_tokens"] == 8


@pytest.mark.slow
def test_a_failed_load_exits_3(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert cli.main(["serve", str(broken), "--port", "0"]) == cli.STARTUP_FAILURE


class Clock:
    """The server's clock, moved by the test (``time`` as its module sees it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class TestSignals:
    """The window's logic, on a server that is not run: what each signal
    and tick does to readiness and to uvicorn's should_exit."""

    def server(self, drain: float, *, ready: bool = True) -> Server:
        app = create_app("unused", thread=MLXThread(name="signals"))
        config = uvicorn.Config(app, log_config=None)
        server = Server(config, readiness=app.state.readiness, unready_seconds=drain)
        server.started = True
        server.lifespan = LifespanOn(config)
        if ready:
            next(iter(app.state.models)).slot.engine = object()  # type: ignore[assignment]
        return server

    def test_the_first_signal_drains_and_waits(self) -> None:
        server = self.server(30)
        server.handle_exit(signal.SIGTERM, None)
        assert server.readiness.draining
        assert not server.should_exit

    def test_a_second_signal_ends_the_wait(self) -> None:
        server = self.server(30)
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit

    @pytest.mark.anyio
    async def test_the_window_ends_on_a_tick(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        clock = Clock()
        monkeypatch.setattr(uvicorn_server, "time", clock)
        server = self.server(0.5)
        server.handle_exit(signal.SIGINT, None)
        assert not await server.on_tick(1)
        clock.now += 0.25
        assert not await server.on_tick(2)
        clock.now += 0.25  # the window's end
        assert await server.on_tick(3)
        assert server.should_exit

    @pytest.mark.parametrize(("drain", "ready"), [(0, True), (30, False)])
    def test_no_window_when_off_or_never_ready(self, drain: float, ready: bool) -> None:
        server = self.server(drain, ready=ready)
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit
        assert server.readiness.draining
