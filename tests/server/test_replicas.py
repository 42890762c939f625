"""Replicas behind nginx, with the configuration docs/deployment.md gives:
two ``serve --demo`` processes on loopback, Debian's nginx in front, the
official ``openai`` client (no retries of its own) sending through it.

nginx is a system package: CI installs it (``.ci/run``), and there a missing
nginx fails the test; elsewhere the test is skipped without it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from mlx_pinned.server.cli import DEMO_MODEL_NAME
from mlx_pinned.testing import image_data_uri

from .replicas import Replica, replica

pytestmark = pytest.mark.timeout(180)

DOCS = Path(__file__).parents[2] / "docs" / "deployment.md"
CONFIG_MARK = "# /etc/nginx/conf.d/mlx-pinned-replicas.conf"


def docs_config() -> str:
    """The nginx block of docs/deployment.md that starts with CONFIG_MARK."""
    blocks = re.findall(r"```nginx\n(.*?)```", DOCS.read_text(), re.DOTALL)
    found = [block for block in blocks if block.startswith(CONFIG_MARK)]
    assert len(found) == 1, "docs/deployment.md has no replicas config for nginx"
    return found[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Nginx:
    """nginx in the foreground with the docs' server block, its ports
    replaced by the test's; its access log has each request's upstreams."""

    def __init__(self, root: Path, replicas: list[int]) -> None:
        binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
        if binary is None:
            message = "nginx is not installed (CI installs it: .ci/run)"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
        self.port = free_port()
        block = docs_config()
        for documented, port in zip(("8001", "8002"), replicas, strict=True):
            block = block.replace(f"127.0.0.1:{documented} ", f"127.0.0.1:{port} ")
        block = block.replace(
            "listen 127.0.0.1:8080;", f"listen 127.0.0.1:{self.port};"
        )
        assert block.count("127.0.0.1:") == 3, block  # every address replaced
        (root / "replicas.conf").write_text(block)
        self.access = root / "access.log"
        temp = "\n".join(
            f"    {kind}_temp_path {root / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        user = "user root;\n" if os.geteuid() == 0 else ""
        (root / "nginx.conf").write_text(
            f"{user}worker_processes 1;\npid {root / 'nginx.pid'};\n"
            f"error_log {root / 'error.log'} info;\n"
            "events { worker_connections 256; }\n"
            "http {\n"
            "    log_format upstreams '$status $upstream_addr $upstream_status';\n"
            f"    access_log {self.access} upstreams;\n{temp}\n"
            f"    include {root / 'replicas.conf'};\n"
            "}\n"
        )
        command = [binary, "-p", str(root), "-c", str(root / "nginx.conf")]
        check = subprocess.run([*command, "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.process = subprocess.Popen([*command, "-g", "daemon off;"])
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            assert self.process.poll() is None, (root / "error.log").read_text()
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.02)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1",
            api_key="unused",
            max_retries=0,  # nginx alone retries
            timeout=60,
        )

    def lines(self) -> list[str]:
        return self.access.read_text().splitlines()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


# Behind a balancer: a request to a replica that loads gets its 503 at once,
# and nginx sends it to the other (docs/deployment.md).
BALANCED = ("--load-wait", "0")


@pytest.fixture
def nginx_for(tmp_path: Path) -> Iterator[type[Nginx]]:
    started: list[Nginx] = []

    class Started(Nginx):
        def __init__(self, root: Path, replicas: list[int]) -> None:
            super().__init__(root, replicas)
            started.append(self)

    yield Started
    for item in started:
        item.stop()


def ask(client: openai.OpenAI, seed: int) -> str:
    content = [
        {"type": "text", "text": "Describe this image."},
        {"type": "image_url", "image_url": {"url": image_data_uri(64, 64, seed=seed)}},
    ]
    answer = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=8,
    )
    assert answer.choices[0].finish_reason in ("length", "stop")
    return answer.id


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """Replicas A (``--unready-seconds 1``) and B, started together."""
    a = Replica(tmp_path / "a.log", "--unready-seconds", "1", *BALANCED)
    b = Replica(tmp_path / "b.log", *BALANCED)
    try:
        a.wait_listening()
        b.wait_listening()
        yield a, b
    finally:
        a.kill()
        b.kill()


def test_the_docs_config_retries_a_503_on_the_other_replica() -> None:
    # What the nginx test below relies on, checked without nginx: the
    # addresses it swaps for its own ports, and a 503 (a replica that
    # loads) sent on to the next replica, POSTs included.
    block = docs_config()
    for address in ("127.0.0.1:8001 ", "127.0.0.1:8002 ", "listen 127.0.0.1:8080;"):
        assert block.count(address) == 1, address
    (retry,) = re.findall(r"proxy_next_upstream ([^;]*);", block)
    assert {"http_503", "non_idempotent"} <= set(retry.split())


@pytest.mark.slow
def test_replicas_behind_nginx(
    tmp_path: Path, two: tuple[Replica, Replica], nginx_for: type[Nginx]
) -> None:
    a, b = two
    a.wait_ready()
    b.wait_ready()
    nginx = nginx_for(tmp_path, [a.port, b.port])
    with nginx.client() as client:
        # Spread: both replicas answer a burst.
        with ThreadPoolExecutor(8) as pool:
            assert len(set(pool.map(lambda i: ask(client, i), range(16)))) == 16
        assert a.chat_statuses().get("200", 0) > 0
        assert b.chat_statuses().get("200", 0) > 0

        # A stopped under load: it drains, nginx moves on, nothing is lost.
        answered: list[str] = []
        stop = threading.Event()

        def load() -> None:
            seed = 100
            while not stop.is_set():
                answered.append(ask(client, seed))
                seed += 1

        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(load) for _ in range(4)]
            while len(answered) < 8:
                assert not any(future.done() for future in running)
                time.sleep(0.01)
            a.terminate()
            assert a.process.wait(timeout=60) == 0
            after = len(answered)
            while len(answered) < after + 8:  # B alone serves on
                assert not any(future.done() for future in running)
                time.sleep(0.01)
            stop.set()
            for future in running:
                future.result()  # a lost request raises here
        assert "draining: /health answers 503" in a.log_text()

        # A restarted on its port: loading, it answers 503, nginx skips it.
        options = ("--port", str(a.port), *BALANCED)
        with replica(tmp_path / "a2.log", *options, gated=True) as again:
            seen = len(nginx.lines())
            deadline = time.monotonic() + 30
            while not any(
                line.endswith(", 200") and "503" in line
                for line in nginx.lines()[seen:]
            ):
                ask(client, 0)
                assert time.monotonic() < deadline, nginx.lines()[seen:]
            assert again.chat_statuses().get("503", 0) > 0
            assert again.chat_statuses().get("200", 0) == 0
            again.open_gate()
            again.wait_ready()
            assert again.status("/health") == 200
    log = a.log_text() + b.log_text()
    assert "Traceback" not in log
    assert " ERROR " not in log
