"""LiteLLM's router in front of two ``serve --demo`` replicas, with the
configuration docs/deployment.md gives (read from the page, its ports
replaced), run by hand: LiteLLM is not a dependency of this project.

::

    python -m venv /tmp/litellm && /tmp/litellm/bin/pip install litellm
    /tmp/litellm/bin/python benchmarks/litellm_router.py \\
        --server-python .venv/bin/python

Three phases, each with ``--concurrency`` clients sending through
``litellm.Router`` (the router's own retries only):

1. spread: ``--requests`` requests; how many each replica answered;
2. drain: the same again while replica A is stopped with SIGTERM
   (``--unready-seconds 1``): failed requests (0 expected) and A's exit status;
3. restart: A started again on its port; requests sent while it loads
   (A answers 503 ``model_not_loaded``) until it is ready: failed requests,
   and the 503s A answered.

Prints one JSON object. The replicas run with ``--server-python`` (a Python
with mlx-pinned installed); this script needs only LiteLLM, PyYAML and httpx.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

DOCS = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"
CONFIG_MARK = "# litellm config.yaml"
MODEL = "qwen3-vl"
CHAT = (
    r'mlx_pinned_requests_total\{route="/v1/chat/completions",'
    r'status="(\d+)"\} (\S+)'
)


def docs_config(ports: list[int]) -> dict[str, Any]:
    """The LiteLLM block of docs/deployment.md, its ports replaced."""
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    (block,) = [block for block in blocks if block.startswith(CONFIG_MARK)]
    for documented, port in zip(("8001", "8002"), ports, strict=True):
        block = block.replace(f"127.0.0.1:{documented}/", f"127.0.0.1:{port}/")
    config: dict[str, Any] = yaml.safe_load(block)
    return config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Replica:
    def __init__(self, python: str, port: int, log: Path, *options: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        command = [python, "-m", "mlx_pinned.server", "serve", "--demo"]
        command += ["--port", str(port), *options]
        with log.open("ab") as sink:
            self.process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"a replica exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("a replica did not load")

    def chat_statuses(self, key: str) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {key}"}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=5).text
        return {code: float(n) for code, n in re.findall(CHAT, text)}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def send(router: Any, count: int, concurrency: int) -> tuple[int, list[str]]:
    """``count`` requests through the router; answered, and the errors."""
    errors: list[str] = []

    def one(index: int) -> None:
        try:
            answer = router.completion(
                model=MODEL,
                messages=[{"role": "user", "content": f"Say something ({index})."}],
                max_tokens=8,
            )
            assert answer.choices[0].message.content is not None
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))
    return count - len(errors), errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-python", default=sys.executable)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    # Both sides: the replicas require the key, LiteLLM reads it (os.environ/).
    key = os.environ.setdefault("MLX_PINNED_API_KEY", secrets.token_hex(16))
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline
    import litellm

    ports = [free_port(), free_port()]
    logs = Path(tempfile.mkdtemp(prefix="litellm-router-"))
    a = Replica(args.server_python, ports[0], logs / "a.log", "--unready-seconds", "1")
    b = Replica(args.server_python, ports[1], logs / "b.log")
    version = importlib.metadata.version("litellm")
    result: dict[str, Any] = {"litellm": version, "logs": str(logs)}
    try:
        a.wait_ready()
        b.wait_ready()
        config = docs_config(ports)
        router = litellm.Router(
            model_list=config["model_list"], **config["router_settings"]
        )

        answered, errors = send(router, args.requests, args.concurrency)
        result["spread"] = {
            "answered": answered,
            "errors": errors,
            "a_200": a.chat_statuses(key).get("200", 0),
            "b_200": b.chat_statuses(key).get("200", 0),
        }

        outcome: dict[str, Any] = {}

        def flow_of_requests() -> None:
            answered, errors = send(router, args.requests, 2)
            outcome.update(answered=answered, errors=errors)

        flow = threading.Thread(target=flow_of_requests)
        flow.start()
        time.sleep(1.0)
        before = a.chat_statuses(key).get("200", 0)
        a.process.send_signal(signal.SIGTERM)
        # Answered by A in its window and while its last requests finished.
        time.sleep(0.5)
        during = a.chat_statuses(key).get("200", 0) - before
        result["drain"] = {"a_200_after_signal": during, "a_exit": a.process.wait(60)}
        flow.join()
        result["drain"].update(outcome)

        a = Replica(args.server_python, ports[0], logs / "a.log")
        restart = []
        while True:
            answered, errors = send(router, 4, 2)
            restart.append((answered, errors))
            try:
                if httpx.get(a.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
        result["restart"] = {
            "answered": sum(item[0] for item in restart),
            "errors": [error for item in restart for error in item[1]],
            "a_statuses": a.chat_statuses(key),
        }
    finally:
        a.stop()
        b.stop()
    print(json.dumps(result, indent=2))
    failed = [
        phase
        for phase in ("spread", "drain", "restart")
        if result.get(phase, {}).get("errors", True)
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
