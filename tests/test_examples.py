"""The examples in examples/ and the Python blocks in docs/, run for real.

Each runs in a fresh subprocess on the tiny model, so it also proves the
process exits cleanly. The first MLX call on a fresh machine compiles kernels
(seconds), hence the generous deadlines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from mlx_pinned import MLXThreadBusyError
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@contextlib.contextmanager
def serving(
    script: str, args: list[str], ready: str, cache: pathlib.Path
) -> Iterator[Server]:
    """``examples/script`` on a free port, once ``ready`` answers 200."""
    port = free_port()
    log = cache / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), "--port", str(port), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=environment(cache),
            cwd=ROOT,
        )
    running = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, running.output()
            try:
                if httpx.get(f"{running.url}{ready}", timeout=5).status_code == 200:
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


@pytest.fixture
def server(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[Server]:
    args = ["--model", str(model_dir)]
    with serving("starlette_server.py", args, "/health", tmp_path) as running:
        yield running


def describe(
    url: str, max_tokens: int, seed: int = 0, size: int = 64
) -> list[dict[str, object]]:
    image = image_data_uri(size, size, seed=seed).partition(",")[2]
    body = {"prompt": "Describe this image.", "image": image, "max_tokens": max_tokens}
    with httpx.stream("POST", f"{url}/describe", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


@pytest.mark.slow
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


# -- examples/openai_server.py, driven by the official openai client ----------

DEMO = "mlx-pinned-demo"
HELLO: Any = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def openai_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No --model: the default tiny model, written to the cache, as DEMO.
    cache = tmp_path_factory.mktemp("openai-server")
    with serving("openai_server.py", [], "/v1/models", cache) as running:
        yield running
        # The last check: SIGTERM stops it cleanly, the MLX thread included.
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(30) == 0, running.output()
        assert "Application shutdown complete" in running.output()
        assert "Traceback" not in running.output()


@pytest.fixture
def client(openai_server: Server) -> Iterator[openai.OpenAI]:
    url = f"{openai_server.url}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        yield client


def text_of(client: openai.OpenAI, **fields: Any) -> tuple[str, str | None]:
    """The content and finish reason of a whole answer of 12 greedy tokens."""
    fields = {"model": DEMO, "messages": HELLO, "max_tokens": 12} | fields
    answer = client.chat.completions.create(**fields)
    return answer.choices[0].message.content or "", answer.choices[0].finish_reason


IMAGE_URL = "messages[0].content[0].image_url.url"


def image_message(url: str) -> list[dict[str, Any]]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return [{"role": "user", "content": [image]}]


class TestOpenAIServer:
    @pytest.mark.slow
    def test_lists_its_model_and_answers_with_usage(
        self, client: openai.OpenAI
    ) -> None:
        assert [model.id for model in client.models.list()] == [DEMO]
        answer = client.chat.completions.create(
            model=DEMO, messages=HELLO, max_tokens=12, temperature=0
        )
        assert answer.object == "chat.completion"
        assert answer.model == DEMO
        [choice] = answer.choices
        assert choice.message.role == "assistant"
        assert choice.message.content  # random weights: some text
        assert choice.finish_reason == "length"
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 12
        assert answer.usage.prompt_tokens > 0
        total = answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert answer.usage.total_tokens == total

    def test_a_stream_carries_the_same_text_then_the_reason_and_usage(
        self, client: openai.OpenAI
    ) -> None:
        whole, _ = text_of(client, temperature=0)
        chunks = list(
            client.chat.completions.create(
                model=DEMO,
                messages=HELLO,
                max_completion_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
        assert "".join(d.delta.content or "" for d in deltas) == whole
        assert [d.finish_reason for d in deltas][-1] == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert chunks[-1].choices == []  # the usage chunk comes last
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 12

    def test_an_image_reaches_the_prompt(self, client: openai.OpenAI) -> None:
        content: Any = [
            {"type": "text", "text": "Describe this image."},
            {"type": "image_url", "image_url": {"url": image_data_uri(64, 64)}},
        ]
        messages: Any = [{"role": "user", "content": content}]
        seen = client.chat.completions.create(
            model=DEMO, messages=messages, max_tokens=6, temperature=0
        )
        messages[0]["content"] = content[:1]
        unseen = client.chat.completions.create(
            model=DEMO, messages=messages, max_tokens=6, temperature=0
        )
        assert seen.choices[0].finish_reason == "length"
        assert seen.usage is not None
        assert unseen.usage is not None
        # The image's tokens sit in the prompt beside the same text.
        assert seen.usage.prompt_tokens > unseen.usage.prompt_tokens + 4

    def test_a_stop_string_cuts_the_answer(self, client: openai.OpenAI) -> None:
        whole, _ = text_of(client, temperature=0)
        stop = whole[len(whole) // 2 :][:3]
        assert len(stop) == 3, whole
        cut, reason = text_of(client, temperature=0, stop=[stop])
        assert (cut, reason) == (whole[: whole.find(stop)], "stop")
        streamed = client.chat.completions.create(
            model=DEMO,
            messages=HELLO,
            max_tokens=12,
            temperature=0,
            stop=stop,
            stream=True,
        )
        deltas = [chunk.choices[0] for chunk in streamed]
        assert "".join(d.delta.content or "" for d in deltas) == cut
        assert deltas[-1].finish_reason == "stop"

    def test_a_seed_repeats_a_sampled_answer(self, client: openai.OpenAI) -> None:
        first = text_of(client, temperature=1.0, seed=3)
        assert text_of(client, temperature=1.0, seed=3) == first
        assert text_of(client, temperature=1.0, seed=4) != first

    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("fields", "param", "code"),
        [
            ({"tools": []}, "tools", "unsupported_parameter"),
            ({"n": 2}, "n", "unsupported_parameter"),
            ({"temperature": 5}, "temperature", "invalid_value"),
            ({"max_tokens": 0}, "max_tokens", "invalid_value"),
            ({"max_tokens": 2.5}, "max_tokens", "invalid_value"),
            ({"stop": [""]}, "stop", "invalid_value"),
            (
                {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
                "messages[0].name",
                "unsupported_parameter",
            ),
            (
                {"messages": [{"role": "tool", "content": "x"}]},
                "messages[0].role",
                "invalid_value",
            ),
            *(
                ({"messages": image_message(url)}, IMAGE_URL, "invalid_value")
                for url in ["https://example.com/cat.png", "data:image/png;base64,AAAA"]
            ),
        ],
    )
    def test_a_field_it_does_not_take_is_a_400_that_names_it(
        self, client: openai.OpenAI, fields: dict[str, Any], param: str, code: str
    ) -> None:
        body = {"model": DEMO, "messages": HELLO} | fields
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**body)
        error = refused.value.body
        assert isinstance(error, dict)
        assert error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == (param, code)
        assert param in error["message"]

    def test_an_unknown_model_is_a_404(self, client: openai.OpenAI) -> None:
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-4o", messages=HELLO)
        error = missing.value.body
        assert isinstance(error, dict)
        assert error["code"] == "model_not_found"
        assert error["param"] == "model"
        assert "gpt-4o" in error["message"]


def block(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(30)


def test_the_openai_server_answers_503_with_retry_after_when_its_thread_is_full(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, uvicorn_thread: Any
) -> None:
    # A fresh copy of the example, with its own MLX thread to fill.
    spec = importlib.util.spec_from_file_location(
        "openai_server", EXAMPLES / "openai_server.py"
    )
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # for its dataclass
    spec.loader.exec_module(example)
    thread = example.mlx_thread
    started, release = threading.Event(), threading.Event()
    app = example.create_app(str(model_dir), "tiny")
    with (
        uvicorn_thread(app) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        blocker = thread.submit(block, started, release)
        try:
            assert started.wait(30)
            # The running job blocks; max_pending queued jobs fill the queue.
            queued = [thread.submit(int) for _ in range(thread.max_pending)]
            with pytest.raises(MLXThreadBusyError):
                thread.submit(int)
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as busy:
                    client.chat.completions.create(
                        model="tiny", messages=HELLO, max_tokens=4, stream=stream
                    )
                assert busy.value.status_code == 503
                assert busy.value.response.headers["retry-after"] == "1"
                error = busy.value.body
                assert isinstance(error, dict)
                assert (error["type"], error["code"]) == ("server_error", "server_busy")
                assert "retry later" in error["message"]
        finally:
            release.set()
        blocker.result(30)
        for job in queued:
            job.result(30)
        # Drained, it answers again (greedy: sampled, the random model can
        # end its answer before max_tokens).
        answer = client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=4, temperature=0
        )
        assert answer.choices[0].finish_reason == "length"
    assert thread.closed  # the lifespan stopped it


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
