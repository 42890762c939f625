"""Every pair of the common settings, started as ``mlx-pinned serve`` starts
them: each pair serves two chats, or is refused in one line with no
traceback.

The command line runs in-process up to uvicorn (its parse, its checks, its
config, ``create_app``), then the app's lifespan and two chats run through
httpx's ASGI transport. The pairs with ``--distributed tensor`` run two
ranks under a supervisor's environment, in the slow set.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from conftest import LifespanFailed

from mlx_pinned.server import cli
from mlx_pinned.server.engine.kv_quant import KVQuant
from mlx_pinned.testing import tiny_lm_path, tiny_vlm_path

from .kit import Lifespan, Served, free_ports, in_process, widen

pytestmark = pytest.mark.anyio
NAME = "m"
KEY = "sk-pairs"

# Each setting as a user gives it ({dir}: a folder of the pair's own).
SETTINGS: dict[str, tuple[str, ...]] = {
    "state-dir": ("--state-dir", "{dir}"),
    "no-prompt-cache": ("--prompt-cache-bytes", "0"),
    "prompt-lookup": ("--prompt-lookup-tokens", "3"),
    "draft-model": ("--draft-model", str(tiny_lm_path())),
    "one-seq": ("--max-num-seqs", "1"),
    "on-first-use": ("--load-on-first-use",),
    "prefill-step": ("--prefill-step-size", "16"),
    "api-key": ("--api-key", KEY),
    "no-image-cache": ("--image-cache-bytes", "0"),
    "kv-bits": ("--kv-bits", "8"),
}
PAIRS = list(itertools.combinations(SETTINGS, 2))
# The pairs refused, and the flags their one line names.
REFUSED = {
    ("prompt-lookup", "draft-model"): ("--draft-model", "--prompt-lookup-tokens")
}
# What each setting leaves in the served model (its engine once loaded):
# no setting of a pair is dropped for the other's sake.
SHOWN: dict[str, Callable[[Served], bool]] = {
    "state-dir": lambda served: served.engine.disk is not None,
    "no-prompt-cache": lambda served: served.engine.prompt_cache.budget == 0,
    "prompt-lookup": lambda served: drafts(served).ngram == 3,
    "draft-model": lambda served: drafts(served).model == str(tiny_lm_path()),
    "one-seq": lambda served: served.app.state.gate.max_num_seqs == 1,
    "on-first-use": lambda served: (
        not served.app.state.models.get(NAME).slot.at_start_up
    ),
    "prefill-step": lambda served: served.engine.loop.state.prefill_step == 16,
    "api-key": lambda served: served.app.state.config.api_key == KEY,
    "no-image-cache": lambda served: served.engine.image_cache is None,
    "kv-bits": lambda served: served.engine.loop.state.kv_quant == KVQuant(8),
}
BODY = {
    "model": NAME,
    "messages": [{"role": "user", "content": "Tell me a story about a dog."}],
    "max_tokens": 6,
    "temperature": 0.0,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny vision model with heads that take ``--kv-bits``."""
    return str(widen(tiny_vlm_path(), tmp_path_factory.mktemp("pairs") / "wide"))


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The apps ``serve`` makes, kept instead of served (no socket)."""
    apps: list[Any] = []

    def keep(server: uvicorn.Server, sockets: Any = None) -> None:
        apps.append(server.config.app)

    monkeypatch.setattr(uvicorn.Server, "run", keep)
    monkeypatch.setattr(cli, "_listen", lambda host, port, backlog: [])
    return apps


def drafts(served: Served) -> Any:
    drafting = served.engine.loop.state.decoder.drafting
    assert drafting is not None
    return drafting.settings


def argv(pair: tuple[str, str], folder: Path) -> list[str]:
    given = [part.format(dir=folder) for name in pair for part in SETTINGS[name]]
    return ["--served-model-name", NAME, "--no-freeze-gc", *given]


def assert_one_line(text: str, names: tuple[str, ...]) -> None:
    """``text`` is one usage error that names each of ``names``."""
    (line,) = text.splitlines()
    assert line.startswith("mlx-pinned: error: "), line
    assert all(name in line for name in names), line


async def two_chats(served: Served, pair: tuple[str, str]) -> list[Any]:
    """Two chats, one after the other: the second starts as the first did,
    to use what the first left (its prompt cache, its drafts)."""
    headers = {"authorization": f"Bearer {KEY}"} if "api-key" in pair else {}
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Tell me a story about a dog."}],
        "max_tokens": 6,
        "temperature": 0.0,
    }
    post = served.client.post
    return [
        await post("/v1/chat/completions", json=body, headers=headers) for _ in "ab"
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("pair", PAIRS, ids="+".join)
async def test_each_pair_serves_two_chats_or_is_refused_in_one_line(
    pair: tuple[str, str],
    model: str,
    started: list[Any],
    lifespan: Lifespan,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="mlx_pinned.server")
    status: object
    try:
        status = cli.main(["serve", model, *argv(pair, tmp_path)])
    except SystemExit as exit:
        status = exit.code
    if pair in REFUSED:
        assert status == 2
        assert_one_line(capsys.readouterr().err, REFUSED[pair])
        return
    assert status == 0, capsys.readouterr().err
    (app,) = started
    try:
        async with in_process(app, lifespan, Served) as served:
            answers = await two_chats(served, pair)
            assert [SHOWN[name](served) for name in pair] == [True, True]
    except LifespanFailed:  # the load refused a setting: in one line?
        (record,) = [r for r in caplog.records if "failed" in r.getMessage()]
        assert record.exc_info is None
        pytest.fail(f"{pair} is refused as the model loads: {record.getMessage()}")
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 6


# With --distributed tensor, the settings a group cannot take are refused in
# every rank, naming these flags.
NOT_DISTRIBUTED = {
    "state-dir": ("--state-dir", "--distributed", "--prompt-cache-disk-bytes 0"),
    "prompt-lookup": ("--prompt-lookup-tokens", "--distributed"),
    "draft-model": ("--draft-model", "--distributed"),
    "on-first-use": ("--load-on-first-use", "--distributed"),
    "kv-bits": ("--kv-bits", "--distributed"),
}
START = 120.0  # seconds for a group to load and serve, on a loaded machine


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [*SETTINGS, "state-dir-responses-only"])
def test_each_setting_with_tensor_parallelism(name: str, tmp_path: Path) -> None:
    # The disk tier off, the state folder keeps the stored responses only.
    own = SETTINGS.get(name, ("--state-dir", "{dir}", "--prompt-cache-disk-bytes", "0"))
    options = [part.format(dir=tmp_path / "state") for part in own]
    http, *ring = free_ports(3)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ring]))
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", str(tiny_vlm_path())]
    command += ["--distributed", "tensor", "--distributed-timeout", "5"]
    command += ["--port", str(http), "--served-model-name", NAME, *options]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    ranks = []
    for index, log in enumerate(logs):
        env = dict(os.environ, MLX_RANK=str(index), MLX_HOSTFILE=str(hostfile))
        with log.open("wb") as sink:
            ranks.append(
                subprocess.Popen(
                    command, stdout=sink, stderr=subprocess.STDOUT, env=env
                )
            )
    try:
        if name in NOT_DISTRIBUTED:
            assert [rank.wait(START) for rank in ranks] == [2, 2]
            for log in logs:
                assert_one_line(log.read_text(), NOT_DISTRIBUTED[name])
            return
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + START
        while not ready(url):
            assert all(rank.poll() is None for rank in ranks), read(logs)
            assert time.monotonic() < deadline, read(logs)
            time.sleep(0.1)
        headers = {"authorization": f"Bearer {KEY}"} if name == "api-key" else {}
        for _ in "ab":
            answer = httpx.post(
                f"{url}/v1/chat/completions", json=BODY, headers=headers, timeout=60
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 6
        for rank in reversed(ranks):  # a supervisor stops every rank
            rank.send_signal(signal.SIGTERM)
        assert [rank.wait(START) for rank in ranks] == [0, 0], read(logs)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait(START)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def read(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs)
