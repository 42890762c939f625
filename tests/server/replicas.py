"""``mlx-pinned serve --demo`` replicas in subprocesses, on free loopback
ports, for the tests of probes, draining and balancers.

A replica may be started *gated*: the real CLI and the real model load, the
load held back until the test opens the gate (a file), so a test sees the
server while it loads for as long as it needs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
READY = "Uvicorn running on"

# Runs the CLI with BatchEngine.load waiting for the gate file first.
GATED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mlx_pinned.server import cli
    from mlx_pinned.server.engine import BatchEngine

    gate = Path(sys.argv[1])
    load = BatchEngine.load.__func__

    def gated(cls, *args, **kwargs):
        while not gate.exists():
            time.sleep(0.01)
        return load(cls, *args, **kwargs)

    BatchEngine.load = classmethod(gated)
    sys.exit(cli.main(sys.argv[2:]))
    """
)


class Replica:
    """One ``serve --demo`` subprocess; :attr:`url` once it listens."""

    def __init__(self, log: Path, *options: str, gated: bool = False) -> None:
        self.log = log
        self.gate = log.with_suffix(".gate") if gated else None
        serve = ["serve", "--demo", *options]
        if "--port" not in options:
            serve += ["--port", "0"]
        if self.gate is None:
            command = [sys.executable, "-m", "mlx_pinned.server", *serve]
        else:
            command = [sys.executable, "-c", GATED, str(self.gate), *serve]
        with log.open("wb") as sink:
            self.process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
        self.url = ""

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_listening(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while (match := LISTENING.search(self.log_text())) is None:
            assert self.process.poll() is None, self.log_text()
            assert time.monotonic() < deadline, "the replica did not listen"
            time.sleep(0.02)
        self.url = match.group(1)

    def wait_ready(self, timeout: float = 90) -> None:
        """Until the models are loaded (uvicorn's line, logged then)."""
        deadline = time.monotonic() + timeout
        while READY not in self.log_text():
            assert self.process.poll() is None, self.log_text()
            assert time.monotonic() < deadline, "the replica did not load"
            time.sleep(0.02)

    def open_gate(self) -> None:
        assert self.gate is not None
        self.gate.touch()

    def status(self, path: str) -> int:
        """The status of ``GET path``; 0 when no connection is made."""
        try:
            return httpx.get(self.url + path, timeout=5).status_code
        except httpx.TransportError:
            return 0

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def chat_statuses(self) -> dict[str, float]:
        """``requests_total`` of the chat route by status, from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        pattern = (
            r'mlx_pinned_requests_total\{route="/v1/chat/completions",'
            r'status="(\d+)"\} (\S+)'
        )
        return {status: float(value) for status, value in re.findall(pattern, text)}


@contextmanager
def replica(log: Path, *options: str, gated: bool = False) -> Iterator[Replica]:
    """``serve --demo OPTIONS`` (on a free port unless ``--port`` is given),
    returned once it listens (its model may still be loading:
    :meth:`Replica.wait_ready`); killed at the end if still running."""
    started = Replica(log, *options, gated=gated)
    try:
        started.wait_listening()
        yield started
    finally:
        started.kill()
