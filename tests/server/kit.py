"""The server tests' shared kit: requests, references, comparisons, fakes
and real servers, in one place (fixtures are in ``conftest.py``).

Test modules import from here, never from each other.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from concurrent.futures import Future
from contextlib import (
    AbstractAsyncContextManager,
    asynccontextmanager,
    contextmanager,
    suppress,
)
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import anyio
import anyio.abc
import httpx
import numpy as np
import openai
import pytest
import safetensors.numpy
from openai.types.chat import ChatCompletionChunk
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, DraftSettings, LoadedModel, driver
from mlx_pinned.server.engine.loop import BatchLoop
from mlx_pinned.server.events import (
    FinalEvent,
    GenerationParams,
    SamplingParams,
    TokenEvent,
)
from mlx_pinned.server.formats import REASONING_FORMATS, TOOL_CALL_FORMATS
from mlx_pinned.server.http import door
from mlx_pinned.server.http.served_models import BatchGate
from mlx_pinned.testing import make_test_image

from .inline import generate_inline
from .openapi import CheckedSyncTransport, CheckedTransport, transports
from .reference import reference_stream

TOL = 1e-5
# A bound for what must happen soon: running out of it means a hang.
WAIT = 30.0

Event = TokenEvent | FinalEvent
Request = tuple[GenerationParams, list[Image.Image]]

PROMPTS = (
    "Describe this image in one sentence.",
    "What is in this picture? Answer in a few words.",
    "Count the objects in the image and list their colours.",
    "Hello! How can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Is this a photo of a dog, a cat or a bird?",
    "Summarise the text below in one paragraph, please.",
    "Green trees, white clouds, yellow sun and a grey road.",
)
# Different prompt lengths, image sizes (so image token counts) and none.
SIZES: tuple[tuple[int, int] | None, ...] = (
    (64, 64),
    (32, 32),
    (96, 64),
    (128, 128),
    None,
    (64, 96),
    (48, 48),
    None,
)


def image(size: tuple[int, int], seed: int) -> Image.Image:
    return Image.open(io.BytesIO(make_test_image(*size, seed=seed))).convert("RGB")


def request(
    index: int,
    max_tokens: int,
    *,
    prompts: Sequence[str] = PROMPTS,
    sizes: Sequence[tuple[int, int] | None] = SIZES,
    **params: Any,
) -> Request:
    """Request ``index``: its own prompt, and its own image size or none."""
    size = sizes[index % len(sizes)]
    content: list[dict[str, Any]] = [
        {"type": "text", "text": prompts[index % len(prompts)]}
    ]
    images = []
    if size is not None:
        content.append({"type": "image_url"})
        images.append(image(size, seed=index))
    params.setdefault("temperature", 0.0)
    params.setdefault("logprobs", True)
    messages = ({"role": "user", "content": content},)
    return generation(messages, max_tokens=max_tokens, **params), images


_SAMPLING = frozenset(f.name for f in fields(SamplingParams))


def generation(*args: Any, **params: Any) -> GenerationParams:
    """A :class:`GenerationParams` from flat keywords: the sampling ones
    (``temperature``, ``seed``, ``logprobs``...) go into its ``sampling``."""
    sampling = {k: params.pop(k) for k in list(params) if k in _SAMPLING}
    return GenerationParams(*args, sampling=SamplingParams(**sampling), **params)


async def solo(thread: MLXThread, loaded: LoadedModel, req: Request) -> list[Event]:
    """mlx-vlm's own loop, alone on the model."""
    stream = thread.iterate(reference_stream, loaded, *req)
    async with stream:
        return [event async for event in stream]


def tokens(events: Sequence[Event]) -> list[TokenEvent]:
    assert isinstance(events[-1], FinalEvent)
    out = [e for e in events[:-1] if isinstance(e, TokenEvent)]
    assert len(out) == len(events) - 1
    return out


def max_logprob_difference(batched: list[Event], alone: list[Event]) -> float:
    """Largest difference of the chosen and top log-probabilities; the
    sequences must have the same tokens, text, length and ending."""
    ours, theirs = tokens(batched), tokens(alone)
    assert len(ours) == len(theirs)
    assert [e.text for e in ours] == [e.text for e in theirs]
    assert batched[-1] == alone[-1]  # text, finish reason, token counts
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        assert a.logprobs is not None
        assert b.logprobs is not None
        assert a.logprobs.token == b.logprobs.token
        assert [t for t, _, _ in a.logprobs.top] == [t for t, _, _ in b.logprobs.top]
        pairs = [(a.logprobs.logprob, b.logprobs.logprob)]
        top = zip(a.logprobs.top, b.logprobs.top, strict=True)
        pairs += [(x, y) for (_, x, _), (_, y, _) in top]
        worst = max(worst, *(abs(x - y) for x, y in pairs))
    return worst


class Collector:
    """Consumes one batched stream inside a gate turn, recording its events."""

    def __init__(
        self, thread: MLXThread, batch: BatchEngine, gate: BatchGate, req: Request
    ) -> None:
        self.thread, self.batch, self.gate, self.req = thread, batch, gate, req
        self.events: list[Event] = []
        self.active_at_start = 0  # slots held when it was admitted, its own included
        self.started = anyio.Event()  # admitted by the gate
        self.two_tokens = anyio.Event()
        self.done = anyio.Event()

    async def run(self, leave: anyio.Event | None = None) -> None:
        """Consume the stream; with ``leave``, stop reading after three events,
        wait for ``leave``, then go away (the stream is closed)."""
        try:
            async with self.gate.turn():
                self.active_at_start = self.gate.active
                self.started.set()
                stream = self.batch.stream(*self.req)
                async with stream:
                    async for event in stream:
                        self.events.append(event)
                        if len(self.events) >= 2:
                            self.two_tokens.set()
                        if leave is not None and len(self.events) == 3:
                            await leave.wait()
                            return
        finally:
            self.two_tokens.set()
            self.done.set()


async def all_at_once(
    thread: MLXThread, batch: BatchEngine, reqs: Sequence[Request], seconds: float = 60
) -> list[Collector]:
    """Run ``reqs`` on ``batch`` together, a slot each and no waiting room;
    each one's :class:`Collector` once all are done."""
    gate = BatchGate(max_num_seqs=len(reqs), max_pending=0)
    runs = [Collector(thread, batch, gate, req) for req in reqs]
    async with deadline(seconds) as group:
        for run in runs:
            group.start_soon(run.run)
    return runs


async def drain(stream: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in stream]


@asynccontextmanager
async def deadline(seconds: float = 60) -> AsyncIterator[anyio.abc.TaskGroup]:
    with anyio.fail_after(seconds):
        async with anyio.create_task_group() as group:
            yield group


@asynccontextmanager
async def mlx_thread_held(thread: MLXThread) -> AsyncIterator[None]:
    """The MLX thread runs nothing else during the block (a job holds it):
    no batch steps, so what a test reads meanwhile stays put."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(WAIT)

    held = thread.submit(hold)
    try:
        assert await anyio.to_thread.run_sync(entered.wait, WAIT)
        yield
    finally:
        release.set()
        await anyio.to_thread.run_sync(held.result, WAIT)


def hold_until(thread: MLXThread, condition: Callable[[], bool]) -> Future[None]:
    """Hold the MLX thread with a job until ``condition()`` (polled there)
    holds, so that the work queued meanwhile runs together after it."""

    def hold() -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            assert time.monotonic() < deadline, "the condition never held"
            time.sleep(0.002)

    return thread.submit(hold)


class Deadlines:
    """Request deadlines that pass when the test says, not by the clock.

    Serve with ``request_timeout=FAR``; :meth:`expire` makes the deadline
    of every request begun so far pass now (each request's deadline is a
    cancel scope of its door, recorded as it is made).
    """

    FAR = 3600.0

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # Each scope, and how far off its deadline was when it was made.
        self.scopes: list[tuple[anyio.CancelScope, float]] = []
        monkeypatch.setattr(door, "anyio", _RecordingDeadlines(self.scopes))

    def expire(self) -> None:
        for scope, left in self.scopes:
            assert self.FAR - WAIT < left <= self.FAR  # request_timeout's
            scope.deadline = -math.inf


class _RecordingDeadlines:
    """``anyio`` as the door module sees it, its deadline scopes kept."""

    def __init__(self, scopes: list[tuple[anyio.CancelScope, float]]) -> None:
        self._scopes = scopes

    def __getattr__(self, name: str) -> Any:
        return getattr(anyio, name)

    def CancelScope(self, **kwargs: Any) -> anyio.CancelScope:
        scope = anyio.CancelScope(**kwargs)
        if "deadline" in kwargs:
            self._scopes.append((scope, kwargs["deadline"] - anyio.current_time()))
        return scope


class SlowModel:
    """Stands in for the engine's generation: one token per ``step`` seconds
    on the MLX thread, until ``max_tokens`` or :attr:`release` is set.
    Records where each generator started and where it was closed, and
    the tokens made (all generations together)."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.release = threading.Event()
        self.started: list[int] = []
        self.closed: list[int] = []
        self.made = 0

    def __call__(
        self, loaded: LoadedModel, params: GenerationParams, images: Any
    ) -> Iterator[TokenEvent | FinalEvent]:
        self.started.append(threading.get_ident())
        n = 0
        try:
            while n < params.max_tokens and not self.release.is_set():
                time.sleep(self.step)
                n += 1
                self.made += 1
                yield TokenEvent("x")
            yield FinalEvent("", "length", 1, n)
        finally:
            self.closed.append(threading.get_ident())


class Served:
    """An app with its lifespan running and an httpx client on it."""

    def __init__(
        self, app: Starlette, client: httpx.AsyncClient, state: dict[str, Any]
    ) -> None:
        self.app = app
        self.client = client
        self.state = state

    @property
    def engine(self) -> BatchEngine:
        engine = next(iter(self.app.state.models)).engine()
        assert isinstance(engine, BatchEngine)
        return engine

    @property
    def model(self) -> LoadedModel:
        return self.engine.loaded

    @property
    def thread(self) -> MLXThread:
        thread: MLXThread = self.app.state.mlx_thread
        return thread

    async def chat(self, body: dict[str, Any] | bytes, **kw: Any) -> httpx.Response:
        if isinstance(body, bytes):
            return await self.client.post("/v1/chat/completions", content=body, **kw)
        return await self.client.post("/v1/chat/completions", json=body, **kw)

    def sdk(self) -> openai.AsyncOpenAI:
        """The openai SDK's client of the app, through :attr:`client`."""
        return openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key="unused",
            http_client=self.client,
            max_retries=0,
        )


@dataclass
class Beside:
    """What the MLX thread ran while a chat stream and a request of another
    model shared it: at each turn of the chat model's loop, how many steps
    the other model had run (``counters().decode_steps``: an encoder's
    passes, a speech model's pieces, a transcription's windows)."""

    seen: list[int]
    first: int  # the other model's steps when the request was sent
    last: int  # and once it was answered

    @property
    def stalls(self) -> list[int]:
        """The other model's step counts that no chat turn saw: where two
        of its steps ran back to back, the chat waiting."""
        return sorted(set(range(self.first, self.last + 1)) - set(self.seen))


async def chat_beside(
    app: Starlette,
    client: httpx.AsyncClient,
    send: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]],
    monkeypatch: pytest.MonkeyPatch,
    *,
    max_tokens: int,
    leave_early: bool = False,
) -> Beside:
    """Stream a chat answer of model ``chat`` and, once its first chunk is
    in, ``send`` a request of the app's other model beside it (which must be
    answered 200); ``leave_early``: the stream is left once that request is
    answered. The chat's loop reads ahead without bound here, so it never
    waits for its reader (however slow the event loop): what is left is the
    order in which the MLX thread takes the two models' work."""
    (other,) = (model for model in app.state.models if model.name != "chat")
    seen: list[int] = []
    turn = BatchLoop.turn

    def watched(loop: BatchLoop) -> Any:
        seen.append(other.engine().counters().decode_steps)
        return turn(loop)

    monkeypatch.setattr(BatchLoop, "turn", watched)
    monkeypatch.setattr(driver, "READ_AHEAD", 1 << 30)
    counts: list[int] = []
    started = anyio.Event()

    async def chat() -> None:
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                started.set()
                if leave_early and counts[1:]:
                    break

    async def beside() -> None:
        await started.wait()
        counts.append(other.engine().counters().decode_steps)
        answer = await send(client)
        counts.append(other.engine().counters().decode_steps)
        assert answer.status_code == 200, answer.text

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(chat)
        tasks.start_soon(beside)
    return Beside(seen, counts[0], counts[1])


def serving_kind(
    path: Path, kind: str, name: str, lifespan: Lifespan
) -> Callable[..., AbstractAsyncContextManager[Served]]:
    """A ``serve`` of one model kind's door tests: an app serving ``path``
    as ``name``, of ``kind`` (and whatever else a test names), its lifespan
    running."""
    from mlx_pinned.server import create_app

    @asynccontextmanager
    async def serve(**options: Any) -> AsyncIterator[Served]:
        options.setdefault("served_model_name", name)
        options.setdefault("model_kind", kind)
        app = create_app(options.pop("model", path), **options)
        async with in_process(app, lifespan, Served) as served:
            yield served

    return serve


def slow_on_asyncio(test: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an async test slow and run it on asyncio alone: for a door's slow
    tests whose subject is the model (a long file, a long speech), not the
    event loop; the door's quick tests run on trio too, in the full suite."""
    only = pytest.mark.parametrize("anyio_backend", ["asyncio"])
    marked: Callable[..., Any] = pytest.mark.slow(only(test))
    return marked


#: The ``serve`` fixture: an app for the options given, its lifespan running.
Serve = Callable[..., AbstractAsyncContextManager[Served]]
#: The ``lifespan`` fixture (``tests/conftest.py``'s ``run_lifespan``).
Lifespan = Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]

S = TypeVar("S")


@asynccontextmanager
async def in_process(
    app: Any,
    lifespan: Lifespan,
    kind: Callable[[Any, httpx.AsyncClient, dict[str, Any]], S],
) -> AsyncIterator[S]:
    """``app`` with its lifespan running and an httpx client on it, as
    ``kind(app, client, state)`` (a :class:`Served`, or a test's own); the
    client checks the answers of OpenAI's paths against OpenAI's document
    (tests/server/openapi.py)."""
    transport = CheckedTransport(httpx.ASGITransport(app=app))
    async with (
        lifespan(app) as state,
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        yield kind(app, client, state)


def logprobs(response: httpx.Response) -> list[float]:
    """The chosen tokens' log-probabilities of a chat answer (status 200)."""
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [entry["logprob"] for entry in content]


def post_scope(path: str, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ASGI scope of a JSON ``POST path``, as a server sends it; with
    ``state``, a copy of the app's lifespan state (as uvicorn gives each
    request)."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    if state is not None:
        scope["state"] = dict(state)
    return scope


#: The httpx the openai SDK uses (httpx2 from openai 3 on).
_SDK_HTTP = sys.modules[openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0]]


class _SDKClient(openai.DefaultHttpxClient):
    """The openai SDK's own client, closed once collected as the SDK's is."""

    def __del__(self) -> None:
        if not self.is_closed:
            self.close()


class _AsyncSDKClient(openai.DefaultAsyncHttpxClient):
    """The openai SDK's own async client, closed once collected as the
    SDK's is (on asyncio)."""

    def __del__(self) -> None:
        if not self.is_closed:
            with suppress(RuntimeError):  # no loop running
                asyncio.get_running_loop().create_task(self.aclose())


# Claude Code as .ci/run installs it (in the venv's npm folder).
CLAUDE = Path(sys.prefix) / "npm" / "node_modules" / ".bin" / "claude"


def ending_model(folder: Path) -> Path:
    """A copy of the tiny model whose ordinary tokens all end the turn."""
    from mlx_pinned.testing import tiny_vlm_path

    shutil.copytree(tiny_vlm_path(), folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    special = {t["id"] for t in vocab["added_tokens"]}
    ordinary = sorted(set(vocab["model"]["vocab"].values()) - special)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = ordinary
        (folder / name).write_text(json.dumps(config))
    return folder


READY = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    # The clients check the answers of OpenAI's paths against OpenAI's
    # document (tests/server/openapi.py).

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=_SDKClient(transport=transports(_SDK_HTTP)[1]()),
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=_AsyncSDKClient(transport=transports(_SDK_HTTP)[0]()),
        )

    def http(
        self, *, limits: httpx.Limits | None = None, **options: Any
    ) -> httpx.Client:
        """An httpx client of the server, checked as :meth:`client` is
        (``limits`` are its transport's)."""
        inner = (
            httpx.HTTPTransport()
            if limits is None
            else httpx.HTTPTransport(limits=limits)
        )
        return httpx.Client(
            base_url=self.url, transport=CheckedSyncTransport(inner), **options
        )

    def anthropic_client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0)


@contextmanager
def running_server(log: Path) -> Iterator[Server]:
    """``serve --demo`` on a free loopback port; killed if still running."""
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", "--demo"]
    command += ["--port", "0", "--max-tokens-limit", "4000"]
    with running(command, log) as served:
        yield served


@contextmanager
def running(command: list[str], log: Path) -> Iterator[Server]:
    """``command`` (a server on port 0) until it says where it listens;
    killed if still running."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
    try:
        deadline = time.monotonic() + 90
        while (match := READY.search(log.read_text(errors="replace"))) is None:
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield Server(process, match.group(1), log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def read_only(folder: Path) -> list[str]:
    """A command's prefix under which ``folder`` (made here) is read-only:
    its mode for a user; for root, whom modes do not stop, an empty
    read-only mount in a mount namespace of the command's own."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return []
    mount = 'mount -t tmpfs -o ro none "$0" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", mount, str(folder)]


def png_header(width: int, height: int) -> bytes:
    """A 1-bit greyscale PNG that claims width x height, with a tiny IDAT."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload)
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def chat_bytes(**fields: Any) -> bytes:
    """A chat request's raw body: model ``m``, one user message, ``fields``."""
    base: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    }
    base.update(fields)
    return json.dumps(base).encode()


def content_of(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e["choices"]
    )


def video_bytes(
    frames: int = 8,
    size: tuple[int, int] = (64, 64),
    *,
    fps: float = 4.0,
    seed: int = 0,
    codec: str = "MJPG",
    suffix: str = ".avi",
) -> bytes:
    """A small video of random frames, written by OpenCV (MJPG in AVI, or
    ``codec="mp4v", suffix=".mp4"``)."""
    import tempfile

    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / f"video{suffix}")
        writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*codec), fps, size)
        for _ in range(frames):
            writer.write(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        writer.release()
        return Path(path).read_bytes()


def video_data_uri(data: bytes, mime: str = "video/x-msvideo") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


#: Two function tools the tool-call tests offer: arguments the grammar can
#: bound (a short city, a day count, an enum).
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


# --- Output formats (tool-call and reasoning markup) -------------------------

#: The markup of every format the registry knows: a tool-call format's
#: markers and a reasoning format's opening and closing.
FORMAT_MARKUP: tuple[str, ...] = tuple(
    sorted(
        {marker for f in TOOL_CALL_FORMATS.values() for marker in f.markers}
        | {marker for f in REASONING_FORMATS.values() for marker in f.markers or ()}
    )
)


def assert_no_markup(*texts: str | None, context: Any = None) -> None:
    """No text of an answer's content or reasoning holds any format's
    markup (:data:`FORMAT_MARKUP`); ``context`` is shown if one does."""
    for text in texts:
        found = [marker for marker in FORMAT_MARKUP if marker in (text or "")]
        assert not found, (found, text, context)


@dataclass
class JoinedChat:
    """A streamed chat answer, its deltas joined: content, reasoning,
    calls (name, arguments) in order, and the finish reason."""

    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    finish: str | None = None


def join_chat_chunks(chunks: Iterable[ChatCompletionChunk]) -> JoinedChat:
    """The deltas of a streamed chat answer's chunks, joined."""
    joined = JoinedChat()
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            joined.content += delta.content or ""
            joined.reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.function and call.function.name:
                    entry[0] = call.function.name
                entry[1] += (call.function and call.function.arguments) or ""
            joined.finish = choice.finish_reason or joined.finish
    joined.calls = [(calls[i][0], calls[i][1]) for i in sorted(calls)]
    return joined


def drive_rows(
    state: Any, reqs: Sequence[Request], joins: Sequence[int]
) -> list[list[int]]:
    """Step ``state`` (a ``BatchState``) on the calling thread until every
    request is done, request ``i`` admitted before step ``joins[i]``; each
    one's tokens."""
    rows: list[Any] = []
    out: list[list[int]] = []
    steps = 0
    while len(rows) < len(reqs) or not all(r.done for r in rows):
        while len(rows) < len(reqs) and steps >= joins[len(rows)]:
            rows.append(state.admit(*reqs[len(rows)]))
            out.append([])
        state.step()
        steps += 1
        for row, got in zip(rows, out, strict=True):
            got += [item.token for item in row.pending]
            row.pending.clear()
    return out


def interleaved(
    thread: MLXThread,
    engine: BatchEngine,
    requests: Sequence[Request],
    starts: Sequence[int] = (),
) -> list[list[Event]]:
    """Run ``requests`` batched on ``engine``, on the MLX thread: request
    ``i`` enters after ``starts[i]`` rounds (one event of every running
    request a round), so rows join mid-decode."""

    def run() -> list[list[Event]]:
        events: list[list[Event]] = [[] for _ in requests]
        streams: dict[int, Iterator[Any]] = {}
        done: set[int] = set()
        round_ = 0
        while len(done) < len(requests):
            for i, (params, images) in enumerate(requests):
                if i in done or (starts and starts[i] > round_):
                    continue
                if i not in streams:
                    streams[i] = generate_inline(engine, params, images)
                event = next(streams[i])
                events[i].append(event)
                if isinstance(event, FinalEvent):
                    done.add(i)
            round_ += 1
        return events

    return thread.run_sync(run)


def drafting_engines(
    thread: MLXThread, loaded: LoadedModel, drafts: DraftSettings
) -> tuple[BatchEngine, BatchEngine]:
    """Two engines on ``loaded``: one without drafts, one drafting with
    ``drafts``."""

    def make() -> tuple[BatchEngine, BatchEngine]:
        on = BatchEngine(loaded, thread)
        on.speculate(drafts)
        return BatchEngine(loaded, thread), on

    return thread.run_sync(make)


def text_request(index: int, max_tokens: int, **params: Any) -> Request:
    """A text-only :func:`request` with the top 3 logprobs of each token."""
    params.setdefault("top_logprobs", 3)
    return request(index, max_tokens, sizes=(None,), **params)


def assert_same_answers(ours: list[Any], theirs: list[Any]) -> None:
    for mine, off in zip(ours, theirs, strict=True):
        assert max_logprob_difference(mine, off) <= TOL


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(served: Any, **kw: object) -> Samples:
    """``GET /metrics`` of a served app, parsed as Prometheus does: each
    sample's value by its name and labels."""
    response = await served.client.get("/metrics", **kw)  # type: ignore[arg-type]
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def widen(source: Path, target: Path, head: int = 64, layers: int = 2) -> Path:
    """A copy of a tiny model whose attention heads have ``head`` values,
    with ``layers`` layers (past the second, copies of it)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    text["head_dim"] = head
    text["num_hidden_layers"] = layers
    rope = text.get("rope_scaling") or {}
    if "mrope_section" in rope:  # halves of the head: temporal, height, width
        rope["mrope_section"] = [head // 4, head // 8, head // 8]
    (target / "config.json").write_text(json.dumps(config))
    weights = safetensors.numpy.load_file(str(target / "model.safetensors"))
    second = "language_model.model.layers.1."
    for name in [name for name in weights if name.startswith(second)]:
        for layer in range(2, layers):
            copy = name.replace(".layers.1.", f".layers.{layer}.")
            weights[copy] = weights[name].copy()
    rng = np.random.default_rng(1)
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    kv_heads = text["num_key_value_heads"]
    shapes = {
        "q_proj": (heads * head, hidden),
        "k_proj": (kv_heads * head, hidden),
        "v_proj": (kv_heads * head, hidden),
        "o_proj": (hidden, heads * head),
    }
    for name in list(weights):
        if not name.startswith("language_model.") or "self_attn" not in name:
            continue
        part = name.rsplit(".", 2)[-2]
        if part in shapes:
            shape = shapes[part]
            drawn = rng.standard_normal(shape) / np.sqrt(shape[1])
            weights[name] = drawn.astype(np.float32)
        elif part in ("q_norm", "k_norm"):
            weights[name] = np.ones((head,), dtype=np.float32)
    safetensors.numpy.save_file(weights, str(target / "model.safetensors"))
    return target


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now (held open together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tokens_of(events: list[Event]) -> list[tuple[int, ...]]:
    """A generation's tokens, each as its bytes (byte-level BPE: one token's
    bytes are its own)."""
    out = []
    for event in events:
        if isinstance(event, TokenEvent):
            assert event.logprobs is not None
            out.append(tuple(event.logprobs.bytes))
    return out


def position_counts(
    thread: MLXThread, engine: BatchEngine, reqs: Sequence[Request], length: int
) -> Counter[tuple[int, ...]]:
    """The (position, token) counts of each answer of ``reqs`` past its first
    token (``length`` tokens each), 8 requests interleaved at a time: what
    :func:`two_sample_chi_square` compares."""
    found: Counter[tuple[int, ...]] = Counter()
    for start in range(0, len(reqs), 8):
        for events in interleaved(thread, engine, list(reqs[start : start + 8])):
            drawn = tokens_of(events)
            found.update((i, *drawn[i]) for i in range(1, length))
    return found


def two_sample_chi_square(
    ours: Counter[tuple[int, ...]], theirs: Counter[tuple[int, ...]]
) -> tuple[float, int]:
    """Pearson's statistic of two equal-sized samples having one
    distribution, tokens seen fewer than 10 times in both pooled; and the
    number of bins."""
    common = [t for t in ours.keys() | theirs.keys() if ours[t] + theirs[t] >= 10]
    rare = [t for t in ours.keys() | theirs.keys() if t not in common]
    bins = [(ours[t], theirs[t]) for t in common]
    if rare:
        bins.append((sum(ours[t] for t in rare), sum(theirs[t] for t in rare)))
    statistic = math.fsum((a - b) ** 2 / (a + b) for a, b in bins if a + b)
    return statistic, len(bins)


def critical(bins: int) -> float:
    """The chi-square value a true distribution exceeds with probability
    1e-3 (Wilson-Hilferty), for ``bins`` bins."""
    df = max(1, bins)
    z = 3.09
    return float(df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3)
