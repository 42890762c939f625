"""The examples in examples/ and the Python blocks in docs/, run for real.

Each runs in a fresh subprocess on the tiny model, so it also proves the
process exits cleanly. The first MLX call on a fresh machine compiles kernels
(seconds), hence the generous deadlines.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from mlx_pinned.testing import image_data_uri, make_tiny_vlm

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"
DEADLINE = 100.0  # seconds; below pytest's 120 s timeout per test


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("examples") / "tiny-vlm")


def environment(cache: pathlib.Path) -> dict[str, str]:
    """Offline, with the default tiny model cached under ``cache``."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MLX_PINNED_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    }


def run_script(
    args: list[str], cache: pathlib.Path, cwd: pathlib.Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=environment(cache),
        cwd=cwd,
        timeout=DEADLINE,
        check=False,
    )


class TestPlainThreads:
    def test_every_worker_gets_its_tokens_and_the_process_exits_zero(
        self, tmp_path: pathlib.Path
    ) -> None:
        # No --model: the script writes and uses the default tiny model.
        done = run_script(
            [str(EXAMPLES / "plain_threads.py"), "--threads", "4", "--max-tokens", "8"],
            tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == [
            *(
                f"worker {i}: job 8 tokens, stream 8 tokens, same ids: True"
                for i in range(4)
            ),
            # the load, then a job and a stream per worker
            "MLX thread: 9 jobs completed, 0 failed",
        ]
        assert "There is no Stream" not in done.stderr
        assert (tmp_path / "tiny-vlm" / "model.safetensors").is_file()


class TestTrioClient:
    def test_tasks_finish_and_the_early_stop_closes_the_stream(
        self, model_dir: pathlib.Path, tmp_path: pathlib.Path
    ) -> None:
        done = run_script(
            [
                str(EXAMPLES / "trio_client.py"),
                "--model",
                str(model_dir),
                "--tasks",
                "3",
                "--max-tokens",
                "6",
            ],
            tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == [
            "task 0: 6 tokens",
            "task 1: 6 tokens",
            "task 2: 6 tokens",
            "stopped early after 3 tokens",
            "MLX thread: 4 completed, 1 cancelled, 0 failed, 0 streams open",
        ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    def __init__(self, process: subprocess.Popen[bytes], url: str, log: pathlib.Path):
        self.process = process
        self.url = url
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def server(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLES / "starlette_server.py"),
                "--port",
                str(port),
                "--model",
                str(model_dir),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=environment(tmp_path),
            cwd=ROOT,
        )
    running = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, running.output()
            try:
                if httpx.get(f"{running.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, running.output()
            time.sleep(0.2)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def describe(
    url: str, max_tokens: int, seed: int = 0, size: int = 64
) -> list[dict[str, object]]:
    image = image_data_uri(size, size, seed=seed).partition(",")[2]
    body = {"prompt": "Describe this image.", "image": image, "max_tokens": max_tokens}
    with httpx.stream("POST", f"{url}/describe", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


class TestStarletteServer:
    def test_streams_tokens_and_exits_zero_on_sigterm(self, server: Server) -> None:
        lines = describe(server.url, max_tokens=12)
        tokens, last = lines[:-1], lines[-1]
        assert len(tokens) == 12
        assert all(isinstance(line["token"], int) for line in tokens)
        assert last["done"] is True
        assert last["tokens"] == 12
        assert last["finish_reason"] == "length"

        bad = httpx.post(
            f"{server.url}/describe", json={"prompt": "x", "image": "not base64!"}
        )
        assert bad.status_code == 400

        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0, server.output()
        log = server.output()
        assert "Application shutdown complete" in log
        assert "There is no Stream" not in log
        assert "Traceback" not in log

    def test_concurrent_requests_all_answer_the_same_tokens(
        self, server: Server
    ) -> None:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: describe(server.url, 8), range(4)))
        ids = [[line["token"] for line in answer[:-1]] for answer in answers]
        assert all(len(tokens) == 8 for tokens in ids)
        assert ids == [ids[0]] * 4  # greedy, same input: the same ids every time
        health = httpx.get(f"{server.url}/health").json()
        assert health == {"pending": 0, "completed": 5}  # the load and 4 streams

    def test_generations_of_different_images_do_not_mix(self, server: Server) -> None:
        # Interleaved item by item, a 32 px generation beside a 128 px one
        # reads the other's rope state on the model: the exclusive key of
        # the example's generate keeps each equal to its run alone.
        sizes = [32, 128, 32, 128]
        alone = {size: describe(server.url, 8, size=size) for size in set(sizes)}
        with ThreadPoolExecutor(len(sizes)) as pool:
            together = list(
                pool.map(lambda size: describe(server.url, 8, size=size), sizes)
            )
        assert together == [alone[size] for size in sizes]


# -- docs/: every ```python block is a complete program ------------------------

BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
# The concept pages; server, security, benchmarks and deployment are tested
# with the code they describe.
PAGES = (
    "cancellation-and-backpressure.md",
    "decorator.md",
    "executor.md",
    "index.md",
    "middleware.md",
    "testing.md",
    "why-one-thread.md",
)


def doc_blocks() -> list[Any]:
    blocks = []
    for page in (DOCS / name for name in PAGES if (DOCS / name).exists()):
        for index, match in enumerate(BLOCK.finditer(page.read_text())):
            blocks.append(
                pytest.param(page.name, match.group(1), id=f"{page.stem}-{index}")
            )
    return blocks


def linked_pages(markdown: str, prefix: str = "") -> set[str]:
    """The docs pages a Markdown text links to (anchors dropped)."""
    return set(
        re.findall(rf"\]\({re.escape(prefix)}([\w-]+\.md)(?:#[\w-]*)?\)", markdown)
    )


def test_every_docs_page_is_linked_from_the_readme_and_the_index() -> None:
    pages = {page.name for page in DOCS.glob("*.md")}
    assert linked_pages((ROOT / "README.md").read_text(), "docs/") == pages
    assert linked_pages((DOCS / "index.md").read_text()) == pages - {"index.md"}
    for name in PAGES:
        if name != "index.md":
            assert BLOCK.search((DOCS / name).read_text()), f"{name}: no example"


@pytest.mark.parametrize(("page", "source"), doc_blocks())
def test_docs_python_block_runs(page: str, source: str, tmp_path: pathlib.Path) -> None:
    done = run_script(["-c", source], tmp_path, cwd=tmp_path)
    assert done.returncode == 0, f"{page}:\n{source}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.splitlines()[-1:] == ["ok"], "every block ends with print('ok')"


# -- README.md: its program, exactly as shown ---------------------------------


def readme_program() -> str:
    match = BLOCK.search((ROOT / "README.md").read_text())
    assert match, "README.md has no python block"
    return match.group(1)


def test_the_readme_program_runs_and_its_generations_match_alone_and_together(
    tmp_path: pathlib.Path,
) -> None:
    done = run_script(["-c", readme_program()], tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.partition(":")[0] for line in lines] == ["32 px", "128 px"]
    for line in lines:
        # Some text came out, and the same ids and text alone and together.
        assert re.fullmatch(r".+: '.+'; the same when run together: True", line)
    assert "There is no Stream" not in done.stderr


def test_the_readme_program_needs_its_exclusive_key(tmp_path: pathlib.Path) -> None:
    keyed = '@on_mlx_thread(exclusive="vlm")'
    program = readme_program()
    assert program.count(keyed) == 1
    done = run_script(
        ["-c", program.replace(keyed, "@on_mlx_thread")], tmp_path, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Interleaved, the 32 px generation reads the 128 px one's state.
    endings = [line.rpartition(" ")[2] for line in done.stdout.splitlines()]
    assert endings == ["False", "True"], done.stdout
