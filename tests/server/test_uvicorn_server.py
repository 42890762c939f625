"""``mlx-pinned serve``'s server, run as a process: a stop past the drain
window ends each stream in its API's words, and the descriptor limit is
said once in the log."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_pinned.server.cli import DEMO_MODEL_NAME

from .kit import WAIT, running

SERVE = [sys.executable, "-m", "mlx_pinned.server", "serve", "--demo", "--port", "0"]
STREAMS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20000,
    },
    "/v1/messages": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20000,
    },
    "/v1/responses": {"input": "hi", "max_output_tokens": 20000},
}


class Reader(threading.Thread):
    """Reads one stream whole; ``begun`` once its first event came."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__()
        self.url, self.body = url, body
        self.begun = threading.Event()
        self.lines: list[str] = []
        self.failure: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=WAIT) as answer:
                assert answer.status_code == 200
                for line in answer.iter_lines():
                    self.begun.set()
                    if line:
                        self.lines.append(line)
        except Exception as exc:  # a body cut short: httpx.RemoteProtocolError
            self.failure = exc
        finally:
            self.begun.set()


def test_a_stop_past_the_drain_window_ends_each_stream_in_its_apis_words(
    tmp_path: Path,
) -> None:
    command = [*SERVE, "--max-tokens-limit", "20000", "--in-flight-timeout", "1"]
    with running(command, tmp_path / "server.log") as server:
        readers = {
            path: Reader(
                server.url + path,
                # Greedy: the same answer each run, and the model's never ends
                # within 20,000 tokens.
                {**body, "model": DEMO_MODEL_NAME, "stream": True, "temperature": 0},
            )
            for path, body in STREAMS.items()
        }
        for reader in readers.values():
            reader.start()
            assert reader.begun.wait(WAIT)
        server.process.send_signal(signal.SIGTERM)
        for reader in readers.values():
            reader.join(WAIT)
        assert server.process.wait(timeout=WAIT) == 0
    for reader in readers.values():
        assert reader.failure is None  # each body was whole
    chat = readers["/v1/chat/completions"].lines
    assert chat[-1] == "data: [DONE]"
    assert json.loads(chat[-2].removeprefix("data: "))["error"]["code"] == (
        "shutting_down"
    )
    messages = readers["/v1/messages"].lines
    assert messages[-2] == "event: error"
    error = json.loads(messages[-1].removeprefix("data: "))["error"]
    assert error["message"] == "The server is shutting down."
    responses = readers["/v1/responses"].lines
    assert responses[-2] == "event: response.failed"
    failed = json.loads(responses[-1].removeprefix("data: "))["response"]
    assert failed["error"]["code"] == "shutting_down"
    log = server.log_text()
    assert "3 requests still running 1.0 s into the shut-down" in log
    assert "Traceback" not in log
    assert " ERROR " not in log


@pytest.mark.slow
def test_near_the_descriptor_limit_one_warning_says_what_to_do(
    tmp_path: Path,
) -> None:
    command = ["sh", "-c", 'ulimit -n 256 && exec "$@"', "sh", *SERVE]
    with running(command, tmp_path / "server.log") as server:
        host, port = server.url.removeprefix("http://").split(":")
        connections = [socket.create_connection((host, int(port))) for _ in range(300)]
        try:
            deadline = time.monotonic() + WAIT
            while "connections open: near" not in server.log_text():
                assert time.monotonic() < deadline, "no warning"
                time.sleep(0.05)
        finally:
            for connection in connections:
                connection.close()
        # Once they are closed, it serves again.
        deadline = time.monotonic() + WAIT
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=WAIT).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    log = server.log_text()
    (line,) = [line for line in log.splitlines() if "connections open" in line]
    assert " WARNING " in line
    assert "near the process's limit of 256 open files" in line
    assert "raise it (ulimit -n, systemd's LimitNOFILE=)" in line
    assert "Traceback" not in log
