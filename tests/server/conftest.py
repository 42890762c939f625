from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import create_app, engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.events import EventStream
from mlx_pinned.testing import image_data_uri, tiny_lm_path, tiny_vlm_path

from .kit import Lifespan, Serve, Served, in_process, post_scope
from .openapi import MISMATCHES

MODEL = "tiny"
PROMPT = "Describe this image in one sentence."


# The server's async tests run on trio too in the full suite; the inner loop
# (-m "not slow") takes asyncio only, the core's own tests still take both.
@pytest.fixture(params=["asyncio", pytest.param("trio", marks=pytest.mark.slow)])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


@pytest.fixture(autouse=True)
def openai_shapes() -> Iterator[None]:
    """Fails a test that received an answer not of OpenAI's shape
    (tests/server/openapi.py), also where the test caught the error."""
    MISMATCHES.clear()
    yield
    found = list(MISMATCHES)
    MISMATCHES.clear()
    assert not found, "\n\n".join(found)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return tiny_vlm_path()


def vision_body(
    max_tokens: int = 8,
    *,
    image_seed: int = 0,
    image_size: tuple[int, int] = (64, 64),
    prompt: str = PROMPT,
    **fields: Any,
) -> dict[str, Any]:
    """The bug report's request shape: text plus a base64 JPEG."""
    url = image_data_uri(*image_size, seed=image_seed)
    content = [
        {"type": "text", "text": prompt},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    body.update(fields)
    return body


@pytest.fixture
def serve(tiny_model_path: Path, lifespan: Lifespan) -> Serve:
    @asynccontextmanager
    async def serve(**options: Any) -> AsyncIterator[Served]:
        options.setdefault("served_model_name", MODEL)
        # A batch of one, unless a test asks for more: several tests count
        # what one generation at a time does. Batches of many have their own
        # tests (test_batching.py, test_batched_app) and serve the
        # end-to-end tests, through the CLI's default.
        options.setdefault("max_num_seqs", 1)
        app = create_app(tiny_model_path, **options)
        async with in_process(app, lifespan, Served) as served:
            yield served

    return serve


def sse_events(text: str) -> list[Any]:
    """The data of each server-sent event; ``[DONE]`` stays a string."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(
    response: httpx.Response,
    status: int,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


async def drive(
    app: Any,
    body: dict[str, Any],
    *,
    disconnect_after: int | None = None,
    leave: anyio.Event | None = None,
    hold: anyio.Event | None = None,
    started: anyio.Event | None = None,
    stall_start: bool = False,
    stalled: anyio.Event | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, list[bytes]]:
    """Call the ASGI app directly, as a server would; the client leaves after
    ``disconnect_after`` body chunks, or when ``leave`` is set; after the
    first body chunk it stops reading until ``hold`` is set. ``started`` is set
    once the first body chunk was sent. A stream's opening alone (its role
    chunk, sent before the first token) is recorded and not counted. With
    ``stall_start`` the first status line's send never returns (a client
    that reads nothing pauses the server's writes) and is not recorded;
    ``stalled`` is set once it waits."""
    raw = json.dumps(body).encode()
    sent: list[bytes] = []
    status = 0
    leave = leave or anyio.Event()
    delivered = False
    stalling = not stall_start

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, stalling
        if message["type"] == "http.response.start":
            if not stalling:
                stalling = True
                if stalled is not None:
                    stalled.set()
                await anyio.sleep_forever()
            status = message["status"]
        elif message["type"] == "http.response.body":
            sent.append(message.get("body", b""))
            if not counted(sent):
                return
            if started is not None:
                started.set()
            if hold is not None:
                await hold.wait()
            if disconnect_after is not None and counted(sent) >= disconnect_after:
                leave.set()
            if not message.get("more_body", False):
                leave.set()

    await app(post_scope(path), receive, send)
    return status, sent


def counted(sent: list[bytes]) -> int:
    """The body chunks of ``sent``, its stream's opening alone left out."""
    opening = sent[0].count(b"data: ") == 1 and b'"role":"assistant"' in sent[0]
    return len(sent) - bool(sent and opening and b'"content":""' in sent[0])


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (state owned by the app has no event to wait on)."""
    while not condition():  # noqa: ASYNC110
        await anyio.sleep(0.001)


T = TypeVar("T")


class AtOnce:
    """Counts how many threads run a wrapped function at once, at most
    (``most``); each call is made ``seconds`` slower so that calls overlap.
    With ``meet``, the first calls wait (a bounded wait) until ``meet`` of
    them run at once: the overlap a bound allows happens whatever the load."""

    def __init__(self, seconds: float, meet: int = 0) -> None:
        self.seconds = seconds
        self.most = 0
        self._running = 0
        self._lock = threading.Lock()
        self._met = threading.Event()
        self._meet = meet

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        def counted(*args: Any, **kwargs: Any) -> T:
            with self._lock:
                self._running += 1
                self.most = max(self.most, self._running)
                if self._running >= self._meet:
                    self._met.set()
            try:
                self._met.wait(60)
                time.sleep(self.seconds)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1

        return counted


def replace_generation(monkeypatch: pytest.MonkeyPatch, fake: Any) -> None:
    """Make the engine run ``fake(loaded, params, images)``, a generator of
    events, on the MLX thread instead of the model (fault injection): each
    request's stream is the fake's ``MLXThread.iterate`` stream."""

    def stream(engine: BatchEngine, params: Any, images: Any = ()) -> EventStream:
        return EventStream(engine.thread.iterate(fake, engine.loaded, params, images))

    monkeypatch.setattr(BatchEngine, "stream", stream)


# The MLX thread and the loaded tiny model of one test module (the engine's
# tests share them).
@pytest.fixture(scope="module")
def thread() -> Iterator[MLXThread]:
    with MLXThread(name="test-batching") as mlx_thread:
        yield mlx_thread


@pytest.fixture(scope="module")
def loaded(thread: MLXThread, tiny_model_path: Path) -> LoadedModel:
    model: LoadedModel = thread.run_sync(engine.load, tiny_model_path)
    return model


@pytest.fixture(scope="module")
def loaded_lm(thread: MLXThread) -> LoadedModel:
    """The tiny text model (Qwen3), loaded on the module's thread."""
    model: LoadedModel = thread.run_sync(engine.load, tiny_lm_path())
    return model
