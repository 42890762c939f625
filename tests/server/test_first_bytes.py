"""A streamed request's first bytes come once the model took its prompt,
and keep-alives while it waits: read off the raw stream of a real server
(uvicorn in a thread of this process) whose first prefill is held on the
MLX thread until the test has read what must come before its end. Orders
and counts only; the official SDKs read the same streams."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import uvicorn

from mlx_pinned.server import create_app
from mlx_pinned.testing import tiny_vlm_path

from .kit import CLAUDE, WAIT, ending_model

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
EVERY = 0.05  # seconds between keep-alives: many come while the test reads


class Held:
    """The model's next prefill (a forward of more than one token per row)
    waits on the MLX thread until :meth:`release`; later ones run at once.
    ``entered`` is set once it waits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, app: Any) -> None:
        engine = next(iter(app.state.models)).engine()
        lm = type(engine.loaded.model.language_model)
        call = lm.__call__
        self.entered = threading.Event()
        self._release = threading.Event()
        self._armed = True

        def held(model: Any, *args: Any, **kwargs: Any) -> Any:
            inputs = kwargs["inputs"] if "inputs" in kwargs else args[0]
            if self._armed and inputs.shape[1] > 1:
                self._armed = False
                self.entered.set()
                assert self._release.wait(WAIT), "the test never released it"
            return call(model, *args, **kwargs)

        monkeypatch.setattr(lm, "__call__", held)

    def release(self) -> None:
        self._release.set()


@contextmanager
def serving(**settings: Any) -> Iterator[tuple[str, Any]]:
    """The tiny model served by uvicorn on a free port, in a thread."""
    settings.setdefault("heartbeat_interval", EVERY)
    model = settings.pop("model", tiny_vlm_path())
    app = create_app(model, served_model_name=MODEL, **settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert thread.is_alive()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(WAIT)


@dataclass
class Door:
    path: str
    body: dict[str, Any]
    opening: Callable[[list[dict[str, Any]]], bool]  # the API's opening events
    keep_alive: str  # a keep-alive, as its lines read
    last: Callable[[list[dict[str, Any]]], bool]  # the stream's end


def _types(events: list[Any]) -> list[str]:
    return [e.get("type", "") if isinstance(e, dict) else e for e in events]


def _role(events: list[Any]) -> list[str | None]:
    return [e["choices"][0]["delta"].get("role") for e in events]


USER = [{"role": "user", "content": "Describe the weather in Paris."}]
DOORS = {
    "chat": Door(
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "max_tokens": 4, "stream": True},
        lambda events: _role(events[:1]) == ["assistant"],
        ": keep-alive",
        lambda events: events[-1] == "[DONE]",
    ),
    "messages": Door(
        "/v1/messages",
        {"model": MODEL, "messages": USER, "max_tokens": 4, "stream": True},
        lambda events: _types(events)[:2] == ["message_start", "ping"],
        "event: ping",
        lambda events: _types(events)[-1] == "message_stop",
    ),
    "responses": Door(
        "/v1/responses",
        {"model": MODEL, "input": USER, "max_output_tokens": 4, "stream": True},
        lambda events: (
            _types(events)[:2] == ["response.created", "response.in_progress"]
        ),
        ": keep-alive",
        lambda events: _types(events)[-1] == "response.incomplete",
    ),
}


class Reader:
    """A raw SSE stream, read block by block (a block: the lines up to an
    empty one)."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.iter_lines()
        self.blocks: list[list[str]] = []

    def block(self) -> list[str]:
        lines: list[str] = []
        for line in self._lines:
            if line == "" and lines:
                self.blocks.append(lines)
                return lines
            if line:
                lines.append(line)
        assert not lines, lines
        return []

    def rest(self) -> None:
        while self.block():
            pass

    def events(self) -> list[Any]:
        """The data of every block read that carries data."""
        found = []
        for lines in self.blocks:
            data = [line[6:] for line in lines if line.startswith("data: ")]
            if data:
                found.append(data[0] if data[0] == "[DONE]" else json.loads(data[0]))
        return found


@pytest.mark.parametrize("door", DOORS)
def test_first_bytes_and_keep_alives_before_the_prefill_ends(
    door: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = DOORS[door]
    with serving(request_timeout=600) as (url, app):
        held = Held(monkeypatch, app)
        with httpx.stream("POST", url + spec.path, json=spec.body, timeout=WAIT) as r:
            # The status and headers came while the prefill waits.
            assert held.entered.wait(WAIT)
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            reader = Reader(r)
            while not spec.opening(reader.events()):
                assert reader.block(), "the stream ended before its opening"
            keep_alives = 0
            while keep_alives < 3:  # three intervals, and the prefill still waits
                lines = reader.block()
                assert lines, "the stream ended while its prefill waited"
                keep_alives += lines[0] == spec.keep_alive
                assert lines[0] == spec.keep_alive or door == "messages", lines
            assert not reader.events()[-1:] or not spec.last(reader.events())
            held.release()
            reader.rest()
        events = reader.events()
        assert spec.opening(events)
        assert spec.last(events)
        if door == "messages":  # its keep-alives are its own pings
            pings = [b for b in reader.blocks if b[0] == "event: ping"]
            assert len(pings) >= 1 + 3
        else:
            comments = [b for b in reader.blocks if b[0] == ": keep-alive"]
            assert len(comments) >= 3


def test_the_sdks_read_streams_with_keep_alives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[bytes] = []
    from mlx_pinned.server.http.outbox import ResponseWriter

    send = ResponseWriter.send

    async def counting(writer: ResponseWriter, body: bytes, **kw: Any) -> None:
        sent.append(body)
        await send(writer, body, **kw)

    monkeypatch.setattr(ResponseWriter, "send", counting)

    def keep_alives() -> int:
        return sum(body in (b": keep-alive\n\n", PING) for body in list(sent))

    with serving(request_timeout=600) as (url, app):
        for read in (_openai_chat, _openai_responses, _anthropic_messages):
            sent.clear()
            held = Held(monkeypatch, app)
            watcher = threading.Thread(target=_release_after, args=(held, keep_alives))
            watcher.start()
            try:
                text = read(url)
            finally:
                held.release()
                watcher.join(WAIT)
            assert keep_alives() >= 3, read.__name__
            assert isinstance(text, str)


PING = b'event: ping\ndata: {"type":"ping"}\n\n'


def _release_after(held: Held, keep_alives: Callable[[], int]) -> None:
    deadline = time.monotonic() + WAIT
    while keep_alives() < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    held.release()


def _user(door: str) -> Any:
    # Another prompt each: a cached one would have no prefill to hold.
    return [{"role": "user", "content": f"Describe the weather ({door})."}]


def _openai_chat(url: str) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=_user("chat"), max_tokens=4, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _openai_responses(url: str) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        stream = client.responses.create(
            model=MODEL, input=_user("responses"), max_output_tokens=4, stream=True
        )
        kinds = [event.type for event in stream]
        assert kinds[0] == "response.created"
        assert kinds[-1] == "response.incomplete"
        return ""


def _anthropic_messages(url: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with (
        client,
        client.messages.stream(
            model=MODEL, messages=_user("messages"), max_tokens=4
        ) as stream,
    ):
        return "".join(stream.text_stream)


def test_a_request_in_the_waiting_room_begins_its_stream_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A batch of one: the second request waits for the first's turn, whose
    # prefill is held; its stream begins one interval in, and keeps alive.
    with serving(max_num_seqs=1, request_timeout=600) as (url, app):
        held = Held(monkeypatch, app)
        chat = DOORS["chat"]
        first = threading.Thread(
            target=lambda: httpx.post(url + chat.path, json=chat.body, timeout=WAIT)
        )
        first.start()
        try:
            assert held.entered.wait(WAIT)
            body = {**chat.body, "messages": _user("waiting")}
            with httpx.stream("POST", url + chat.path, json=body, timeout=WAIT) as r:
                assert r.status_code == 200
                reader = Reader(r)
                reader.block()
                assert _role(reader.events()) == ["assistant"]
                assert app.state.gate.waiting == 1  # still in the room
                assert [reader.block()[0] for _ in range(3)] == [": keep-alive"] * 3
                held.release()
                reader.rest()
            assert reader.events()[-1] == "[DONE]"
        finally:
            held.release()
            first.join(WAIT)


def test_a_refusal_after_the_stream_began_is_its_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine counts a prompt's tokens when it takes it: one that waited
    # in the room past an interval, and is then over the limit, began its
    # stream; the refusal ends it with the API's error chunk.
    with serving(max_num_seqs=1, max_prompt_tokens=45, request_timeout=600) as (
        url,
        app,
    ):
        held = Held(monkeypatch, app)
        chat = DOORS["chat"]
        first = threading.Thread(
            target=lambda: httpx.post(url + chat.path, json=chat.body, timeout=WAIT)
        )
        first.start()
        try:
            assert held.entered.wait(WAIT)
            long = [{"role": "user", "content": "word " * 60}]
            body = {**chat.body, "messages": long}
            with httpx.stream("POST", url + chat.path, json=body, timeout=WAIT) as r:
                assert r.status_code == 200
                reader = Reader(r)
                reader.block()
                held.release()
                reader.rest()
            error = reader.events()[-2]
            assert error["error"]["code"] == "context_length_exceeded"
            assert reader.events()[-1] == "[DONE]"
        finally:
            held.release()
            first.join(WAIT)


@pytest.mark.anyio
async def test_prompt_progress_comes_before_the_first_token(serve: Any) -> None:
    # Chunks of 8 tokens, each its own step: progress chunks (llama.cpp's
    # shape), then the tokens; none without return_progress. A reader that
    # falls behind the steps gets the latest progress only, so how many
    # chunks, and from where, depends on the load.
    async with serve(prefill_step_size=8, prefill_step_seconds=None) as served:
        body = {**DOORS["chat"].body, "return_progress": True}
        answer = await served.chat(body)
        events = [json.loads(d) for d in _data(answer.text) if d != "[DONE]"]
        progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
        assert _role(events[:1]) == ["assistant"]
        first_token = next(
            i
            for i, e in enumerate(events)
            if e["choices"] and e["choices"][0]["delta"].get("content")
        )
        assert all("prompt_progress" not in e for e in events[first_token:])
        total = progress[0]["total"]
        assert total > 16  # more than two chunks
        assert {p["total"] for p in progress} == {total}
        processed = [p["processed"] for p in progress]
        assert processed == sorted(processed)
        assert len(set(processed)) == len(processed)  # only where it moved
        assert processed[-1] == total
        assert all(p["cache"] == 0 and p["time_ms"] >= 0 for p in progress)
        assert all(e["choices"] == [] for e in events if "prompt_progress" in e)
        plain = await served.chat({**body, "return_progress": False})
        assert "prompt_progress" not in plain.text


def _data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.slow
@pytest.mark.parametrize("heartbeats", [True, False])
def test_claude_code_waits_out_a_long_prefill(
    heartbeats: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Its first request's prefill is held for twice its API_TIMEOUT_MS: with
    # heartbeats its headers came at once, so it waits and asks once; without,
    # it gives up on the first request (the server logs a 499) and retries.
    assert CLAUDE.exists(), f"install Claude Code as .ci/run does: {CLAUDE}"
    timeout_ms = 4000
    model = ending_model(tmp_path / "ending")
    lines: list[str] = []
    handler = _Lines(lines)
    logger = logging.getLogger("mlx_pinned.server")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    settings = {"heartbeat_interval": 1.0 if heartbeats else 0}
    try:
        with serving(
            model=model, max_tokens_limit=32000, request_timeout=600, **settings
        ) as (url, app):
            held = Held(monkeypatch, app)
            timer = threading.Timer(2 * timeout_ms / 1000, held.release)
            timer.start()
            env = {
                "PATH": os.environ["PATH"],
                "HOME": str(tmp_path),
                "ANTHROPIC_BASE_URL": url,
                "ANTHROPIC_API_KEY": "x",
                "API_TIMEOUT_MS": str(timeout_ms),
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
            }
            command = [str(CLAUDE), "-p", "hi", "--model", MODEL, "--bare"]
            done = subprocess.run(
                [*command, "--tools", "Read"],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                timeout=100,
                check=False,
            )
            timer.cancel()
            held.release()
            assert held.entered.is_set()
    finally:
        logger.removeHandler(handler)
    assert done.returncode == 0, done.stdout + done.stderr
    posts = [line for line in lines if "POST /v1/messages" in line]
    if heartbeats:
        assert posts, lines
        assert all(" 200 " in line for line in posts), posts
    else:
        gave_up = [line for line in posts if " 499 " in line]
        assert gave_up, posts
        assert len(posts) > len(gave_up)  # and a retry answered


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
