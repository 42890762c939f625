"""Tensor-parallel serving: two ranks of a ring group on loopback, CPU.

Each group is ``serve --demo --distributed tensor`` twice, started as a
supervisor would start it (``MLX_RANK`` and ``MLX_HOSTFILE`` per rank, as
docs/distributed.md says), so the tests see each rank's exit status, which
``mlx.launch`` hides. Every wait is bounded: a group that hangs fails the
test and is killed. The module's first group serves the end-to-end tests,
then its follower is killed; the others each end another way (a stalled
follower, SIGTERM).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from mlx_pinned.server import create_app
from mlx_pinned.server.cli import DEMO_MODEL_NAME
from mlx_pinned.testing import image_data_uri, tiny_vlm_path

from .kit import free_ports

pytestmark = pytest.mark.timeout(180)

START = 120.0  # seconds for a group to load and serve, on a loaded machine
END = 30.0  # seconds for any rank to exit once it should
TIMEOUT = 2.0  # --distributed-timeout of the groups here
# The tiny model's end-of-turn and end-of-text tokens never sampled: a long
# stream runs its whole length.
NO_END = {"0": -100, "2": -100}


@dataclass
class Group:
    """Two ranks of ``serve --demo --distributed tensor``; rank 0 on ``url``."""

    ranks: list[subprocess.Popen[bytes]]
    logs: list[Path]
    url: str

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60
        )

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def wait_for(self, check: Callable[[], bool], what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {seconds} s\n" + (
                "\n".join(f"--- rank {r}\n{self.log(r)}" for r in range(2))
            )
            time.sleep(0.05)

    def exit_status(self, rank: int, seconds: float = END) -> int:
        try:
            return self.ranks[rank].wait(seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"rank {rank} did not exit within {seconds} s:\n{self.log(rank)}"
            )


@contextmanager
def running_group(folder: Path, *options: str) -> Iterator[Group]:
    """A group on free loopback ports; every rank still running at the end
    is killed."""
    http, *ring = free_ports(3)
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ring]))
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", "--demo"]
    command += ["--distributed", "tensor", "--port", str(http)]
    command += ["--distributed-timeout", str(TIMEOUT), *options]
    ranks, logs = [], []
    for rank in range(2):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        logs.append(folder / f"rank{rank}.log")
        with logs[-1].open("wb") as sink:
            ranks.append(
                subprocess.Popen(
                    command, stdout=sink, stderr=subprocess.STDOUT, env=env
                )
            )
    group = Group(ranks, logs, f"http://127.0.0.1:{http}")
    try:

        def ready() -> bool:
            for rank, process in enumerate(ranks):
                assert process.poll() is None, group.log(rank)
            try:
                return group.health().status_code == 200
            except httpx.HTTPError:
                return False

        group.wait_for(ready, "the group serving", START)
        yield group
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(END)


def vision_messages(size: int, seed: int, words: int) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "text", "text": " ".join(["describe"] * words)}
    ]
    if size:
        url = image_data_uri(size, size, seed=seed)
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


# Greedy and seeded requests of different lengths, with images of different
# sizes and without: several decode together.
REQUESTS = [
    {"messages": vision_messages(size, seed, words), "max_tokens": 10, **sampling}
    for (size, seed, words), sampling in zip(
        [(64, 0, 3), (0, 0, 9), (32, 1, 1), (96, 2, 5), (0, 0, 2), (64, 3, 4)],
        [
            {"temperature": 0.0},
            {"temperature": 0.0},
            {"temperature": 0.0},
            {"temperature": 1.0, "seed": 11},
            {"temperature": 0.8, "seed": 5, "top_p": 0.9},
            {"temperature": 0.0},
        ],
        strict=True,
    )
]


def answer(client: openai.OpenAI, request: dict[str, Any]) -> list[tuple[str, float]]:
    completion = client.chat.completions.create(
        model=DEMO_MODEL_NAME, logprobs=True, top_logprobs=2, **request
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    return [(item.token, item.logprob) for item in logprobs.content]


def assert_same(
    found: list[tuple[str, float]], expected: list[tuple[str, float]]
) -> None:
    assert [token for token, _ in found] == [token for token, _ in expected]
    gaps = [abs(a - b) for (_, a), (_, b) in zip(found, expected, strict=True)]
    assert max(gaps) < 1e-4, gaps


@pytest.fixture(scope="module")
def one_process() -> list[list[tuple[str, float]]]:
    """Each request's answer from the whole model in this process."""
    app = create_app(tiny_vlm_path(), served_model_name=DEMO_MODEL_NAME)
    with TestClient(app) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http
        )
        return [answer(client, request) for request in REQUESTS]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    with running_group(tmp_path_factory.mktemp("tensor")) as running:
        yield running


def ranks(group: Group, expected: list[int]) -> Callable[[], bool]:
    """Whether /health says each rank holds ``expected`` rows."""

    def check() -> bool:
        found = group.health().json()["models"][DEMO_MODEL_NAME]["ranks"]
        return bool(found == expected)

    return check


class TestServing:
    @pytest.mark.slow
    def test_concurrent_requests_answer_as_one_process(
        self, group: Group, one_process: list[list[tuple[str, float]]]
    ) -> None:
        client = group.client()
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            found = list(pool.map(lambda r: answer(client, r), REQUESTS))
        for mine, theirs in zip(found, one_process, strict=True):
            assert_same(mine, theirs)
        # Alone, each gets the same answer again.
        assert_same(answer(client, REQUESTS[3]), one_process[3])

    def test_unseeded_sampling_agrees_across_ranks(self, group: Group) -> None:
        # Rank 0 draws each row's seed: a follower that sampled another token
        # would find it in rank 0's next message and stop the group.
        client = group.client()
        request = {
            "messages": vision_messages(32, 4, 2),
            "max_tokens": 12,
            "temperature": 1.0,
        }
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            found = list(pool.map(lambda _: answer(client, request), range(4)))
        assert len({tuple(tokens) for tokens in found}) > 1  # sampled, unseeded
        group.wait_for(ranks(group, [0, 0]), "both ranks idle", 30)
        assert "diverged" not in group.log(1)

    @pytest.mark.slow
    def test_schema_rows_drawn_unmasked_agree_across_ranks(self, group: Group) -> None:
        # Greedy schema rows that read no log-probabilities draw without
        # their mask; where a rank's grammar refuses a token, every rank
        # must cut its cache back and build the step again alike.
        schema = {
            "type": "object",
            "properties": {"caption": {"type": "string", "maxLength": 60}},
            "required": ["caption"],
            "additionalProperties": False,
        }
        bodies = [
            {
                "messages": vision_messages(size, seed, 3),
                "max_tokens": 40,
                "temperature": 0.0,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "scene", "schema": schema},
                },
            }
            for size, seed in [(64, 6), (0, 0), (32, 7), (96, 8)]
        ]

        def content(client: openai.OpenAI, body: dict[str, Any]) -> tuple[str, str]:
            done = client.chat.completions.create(model=DEMO_MODEL_NAME, **body)
            choice = done.choices[0]
            return choice.message.content or "", choice.finish_reason

        app = create_app(tiny_vlm_path(), served_model_name=DEMO_MODEL_NAME)
        with TestClient(app) as http:
            whole = openai.OpenAI(
                base_url="http://testserver/v1", api_key="unused", http_client=http
            )
            expected = [content(whole, body) for body in bodies]
        client = group.client()
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            found = list(pool.map(lambda body: content(client, body), bodies))
        assert found == expected
        for text, finish in found:
            if finish == "stop":
                assert set(json.loads(text)) == {"caption"}
            else:
                assert text.startswith('{"caption":"')
        group.wait_for(ranks(group, [0, 0]), "both ranks idle", 30)
        assert "diverged" not in group.log(1)

    @pytest.mark.slow
    def test_a_disconnect_frees_the_row_on_both_ranks(self, group: Group) -> None:
        stream = group.client().chat.completions.create(
            model=DEMO_MODEL_NAME,
            messages=vision_messages(64, 5, 3),
            max_tokens=4000,
            logit_bias=NO_END,
            stream=True,
        )
        chunks = iter(stream)
        next(chunks)

        group.wait_for(ranks(group, [1, 1]), "the row on both ranks", 30)
        stream.close()
        group.wait_for(ranks(group, [0, 0]), "the row gone from both ranks", 30)

    @pytest.mark.slow
    def test_a_killed_follower_is_a_503_then_exit_status_1(self, group: Group) -> None:
        # Last: the group ends here.
        group.ranks[1].kill()
        group.wait_for(
            lambda: group.health().status_code == 503, "rank 0's /health 503", 30
        )
        assert group.exit_status(0) == 1
        assert "the tensor-parallel group is lost" in group.log(0)


@pytest.mark.slow
def test_a_stalled_follower_stops_the_group(tmp_path: Path) -> None:
    with running_group(tmp_path) as group:
        group.ranks[1].send_signal(signal.SIGSTOP)
        try:
            group.wait_for(
                lambda: group.health().status_code == 503, "rank 0's /health 503", 30
            )
            assert group.exit_status(0) == 1
            assert "took more than" in group.log(0)
        finally:
            group.ranks[1].send_signal(signal.SIGCONT)
        # Rank 0 is gone: the follower finds it at once.
        assert group.exit_status(1) == 1
        assert "the tensor-parallel group is lost" in group.log(1)


@pytest.mark.slow
def test_sigterm_drains_and_every_rank_exits_0(tmp_path: Path) -> None:
    with running_group(tmp_path) as group:
        stream = group.client().chat.completions.create(
            model=DEMO_MODEL_NAME,
            messages=vision_messages(32, 6, 2),
            max_tokens=150,
            logit_bias=NO_END,
            stream=True,
        )
        chunks = iter(stream)
        next(chunks)
        # A supervisor stops every rank: the follower waits for rank 0's stop.
        for process in reversed(group.ranks):
            process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert group.exit_status(0) == 0
        assert group.exit_status(1) == 0
        assert "rank 0 stopped the group" in group.log(1)
