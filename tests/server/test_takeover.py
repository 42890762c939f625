"""A keyed request whose client goes away keeps running; a retry with its
``Idempotency-Key`` and body takes it over and gets its answer from the
start, on every generation door, with its prompt prefilled once. Driven as
a server would (raw ASGI), with the model's forward held on the MLX thread
while the test disconnects and retries."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from mlx_pinned.server.http.takeover import Reader, Run

from .conftest import MODEL, until
from .kit import WAIT, Serve, Served, post_scope

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

USER = [{"role": "user", "content": "Name three colours of the sea."}]
TOKENS = 12
KEY = "a3f1-retry"


class Paused:
    """The model's ``at``-th forward from now waits on the MLX thread until
    :meth:`release` (``entered`` is set once it waits); the rest run at once."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, served: Served, at: int
    ) -> None:
        lm = type(served.model.model.language_model)
        call = lm.__call__
        self.entered = threading.Event()
        self._release = threading.Event()
        self._left = at

        def paused(model: Any, *args: Any, **kwargs: Any) -> Any:
            self._left -= 1
            if self._left == 0:
                self.entered.set()
                assert self._release.wait(WAIT), "the test never released it"
            return call(model, *args, **kwargs)

        monkeypatch.setattr(lm, "__call__", paused)

    def release(self) -> None:
        self._release.set()


class Client:
    """One request's client: it reads until ``leave`` is set, then goes away
    (what the server sends after is dropped, as uvicorn drops it)."""

    def __init__(
        self,
        path: str,
        body: dict[str, Any],
        key: str | None,
        indent: int | None = None,
    ) -> None:
        self.path = path
        self.raw = json.dumps(body, indent=indent).encode()
        self.key = key
        self.status = 0
        self.sent: list[bytes] = []
        self.leave = anyio.Event()
        self.done = anyio.Event()

    @property
    def body(self) -> bytes:
        return b"".join(self.sent)

    async def ask(self, app: Any) -> None:
        scope = post_scope(self.path)
        if self.key is not None:
            scope["headers"].append((b"idempotency-key", self.key.encode()))
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": self.raw, "more_body": False}
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if self.leave.is_set():
                return
            if message["type"] == "http.response.start":
                self.status = message["status"]
            else:
                self.sent.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self.leave.set()

        try:
            await app(scope, receive, send)
        finally:
            self.done.set()


def objects(body: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a stream: server-sent events' data, or NDJSON."""
    found = []
    for line in body.decode().splitlines():
        data = line.removeprefix("data: ")
        if data.startswith("{"):
            found.append(json.loads(data))
    return found


Logprobs = list[tuple[str, float]]


def _chat(o: dict[str, Any]) -> tuple[str, Logprobs]:
    choice = (o.get("choices") or [{}])[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    text = (choice.get("delta") or {}).get("content") or ""
    return text, [(c["token"], c["logprob"]) for c in content]


def _completions(o: dict[str, Any]) -> tuple[str, Logprobs]:
    choice = (o.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {"tokens": [], "token_logprobs": []}
    pairs = zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)
    return choice.get("text") or "", list(pairs)


def _responses(o: dict[str, Any]) -> tuple[str, Logprobs]:
    return (o["delta"] if o.get("type") == "response.output_text.delta" else ""), []


def _messages(o: dict[str, Any]) -> tuple[str, Logprobs]:
    if o.get("type") != "content_block_delta":
        return "", []
    return o["delta"].get("text") or "", []


def _ollama(field: str) -> Callable[[dict[str, Any]], tuple[str, Logprobs]]:
    def read(o: dict[str, Any]) -> tuple[str, Logprobs]:
        text = o["message"]["content"] if field == "message" else o[field]
        return text, [(e["token"], e["logprob"]) for e in o.get("logprobs") or []]

    return read


@dataclass
class Door:
    path: str
    body: dict[str, Any]
    read: Callable[[dict[str, Any]], tuple[str, Logprobs]]

    def answer(self, body: bytes) -> tuple[str, Logprobs]:
        """Its text and its tokens' log-probabilities."""
        text, logprobs = "", []
        for o in objects(body):
            more, pairs = self.read(o)
            text += more
            logprobs += pairs
        return text, logprobs


GREEDY = {"model": MODEL, "temperature": 0.0, "stream": True}
DOORS = {
    "chat": Door(
        "/v1/chat/completions",
        {**GREEDY, "messages": USER, "max_tokens": TOKENS, "logprobs": True},
        _chat,
    ),
    "completions": Door(
        "/v1/completions",
        {**GREEDY, "prompt": "The colours of the sea", "max_tokens": TOKENS}
        | {"logprobs": 2},
        _completions,
    ),
    "responses": Door(
        "/v1/responses",
        {**GREEDY, "input": USER, "max_output_tokens": TOKENS},
        _responses,
    ),
    "messages": Door(
        "/v1/messages",
        {**GREEDY, "messages": USER, "max_tokens": TOKENS},
        _messages,
    ),
    "ollama chat": Door(
        "/api/chat",
        {"model": MODEL, "messages": USER, "logprobs": True}
        | {"options": {"temperature": 0.0, "num_predict": TOKENS}},
        _ollama("message"),
    ),
    "ollama generate": Door(
        "/api/generate",
        {"model": MODEL, "prompt": "The colours of the sea", "logprobs": True}
        | {"options": {"temperature": 0.0, "num_predict": TOKENS}},
        _ollama("response"),
    ),
}


def runs(served: Served) -> dict[tuple[str, str], Run]:
    found: dict[tuple[str, str], Run] = served.app.state.takeovers.runs
    return found


def only(served: Served) -> Run:
    (run,) = runs(served).values()
    return run


async def gone(
    served: Served,
    monkeypatch: pytest.MonkeyPatch,
    door: Door,
    group: anyio.abc.TaskGroup,
    key: str = KEY,
) -> tuple[Client, Paused, Run]:
    """A keyed request started in ``group`` whose client went away after
    its first token, its model held at its fourth forward: its client, the
    hold, and its run."""
    paused = Paused(monkeypatch, served, at=4)
    first = Client(door.path, door.body, key)
    group.start_soon(first.ask, served.app)
    assert await anyio.to_thread.run_sync(paused.entered.wait, WAIT)
    await until(lambda: bool(door.answer(first.body)[0]))
    first.leave.set()
    run = only(served)
    await until(lambda: run.reader is Reader.NONE)
    return first, paused, run


@pytest.mark.parametrize("name", DOORS)
async def test_a_retry_takes_over_a_run_whose_client_went_away(
    name: str, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    door = DOORS[name]
    async with serve(request_timeout=600) as served:
        prefills = served.engine.statistics().prefills
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                first, paused, run = await gone(served, monkeypatch, door, group)
                # The same body, its fields in another order and spaced.
                reordered = dict(reversed(list(door.body.items())))
                retry = Client(door.path, reordered, KEY, indent=2)
                group.start_soon(retry.ask, served.app)
                await until(lambda: run.reader is Reader.RETRY)
                paused.release()
                await retry.done.wait()
        assert served.engine.statistics().prefills == prefills + 1
        assert runs(served) == {}
        assert retry.status == 200
        assert retry.body.startswith(first.body)  # its answer, from the start
        assert len(retry.body) > len(first.body)
        fresh = Client(door.path, door.body, None)
        await fresh.ask(served.app)
    assert fresh.status == 200
    text, logprobs = door.answer(retry.body)
    fresh_text, fresh_logprobs = door.answer(fresh.body)
    assert text
    assert text == fresh_text
    assert [t for t, _ in logprobs] == [t for t, _ in fresh_logprobs]
    pairs = zip(logprobs, fresh_logprobs, strict=True)
    assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in pairs)
    assert bool(logprobs) == ("logprobs" in door.body)


async def test_a_retry_takes_over_a_whole_answer_too(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    door = DOORS["chat"]
    body = {**door.body, "stream": False}
    async with serve(request_timeout=600) as served:
        prefills = served.engine.statistics().prefills
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                paused = Paused(monkeypatch, served, at=4)
                first = Client(door.path, body, KEY)
                group.start_soon(first.ask, served.app)
                assert await anyio.to_thread.run_sync(paused.entered.wait, WAIT)
                first.leave.set()
                run = only(served)
                await until(lambda: run.reader is Reader.NONE)
                retry = Client(door.path, body, KEY)
                group.start_soon(retry.ask, served.app)
                await until(lambda: run.reader is Reader.RETRY)
                paused.release()
        assert served.engine.statistics().prefills == prefills + 1
        assert runs(served) == {}
        fresh = await served.chat(body)
    assert first.sent == []
    assert retry.status == 200
    answer = json.loads(retry.body)
    assert answer["choices"][0]["message"] == fresh.json()["choices"][0]["message"]
    assert answer["choices"][0]["logprobs"]["content"]
    pairs = zip(
        answer["choices"][0]["logprobs"]["content"],
        fresh.json()["choices"][0]["logprobs"]["content"],
        strict=True,
    )
    assert all(abs(a["logprob"] - b["logprob"]) <= 1e-5 for a, b in pairs)


def error_of(client: Client, status: int) -> str:
    """The error's text, in its door's shape, checked to name the header."""
    assert client.status == status, client.body
    assert "Idempotency-Key" in client.body.decode()
    return client.body.decode()


@pytest.mark.parametrize("name", ["chat", "messages", "ollama chat"])
async def test_a_key_whose_run_a_client_reads_is_refused_409(
    name: str, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    door = DOORS[name]
    async with serve(request_timeout=600) as served:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                paused = Paused(monkeypatch, served, at=4)
                first = Client(door.path, door.body, KEY)
                group.start_soon(first.ask, served.app)
                assert await anyio.to_thread.run_sync(paused.entered.wait, WAIT)
                while_first = Client(door.path, door.body, KEY)
                await while_first.ask(served.app)
                first.leave.set()
                run = only(served)
                await until(lambda: run.reader is Reader.NONE)
                retry = Client(door.path, door.body, KEY)
                group.start_soon(retry.ask, served.app)
                await until(lambda: run.reader is Reader.RETRY)
                while_retry = Client(door.path, door.body, KEY)
                await while_retry.ask(served.app)
                paused.release()
        assert runs(served) == {}
    for refused in (while_first, while_retry):
        text = error_of(refused, 409)
        if name == "chat":
            assert json.loads(text)["error"]["param"] == "Idempotency-Key"
        if name == "messages":
            assert json.loads(text)["type"] == "error"
    assert retry.status == 200
    assert retry.body.startswith(first.body)


async def test_a_retry_whose_client_goes_leaves_the_run_to_the_next(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    door = DOORS["messages"]
    async with serve(request_timeout=600) as served:
        prefills = served.engine.statistics().prefills
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                first, paused, run = await gone(served, monkeypatch, door, group)
                retry = Client(door.path, door.body, KEY)
                group.start_soon(retry.ask, served.app)
                await until(lambda: run.reader is Reader.RETRY)
                retry.leave.set()
                await until(lambda: run.reader is Reader.NONE)
                last = Client(door.path, door.body, KEY)
                group.start_soon(last.ask, served.app)
                await until(lambda: run.reader is Reader.RETRY)
                paused.release()
        assert served.engine.statistics().prefills == prefills + 1
        assert runs(served) == {}
    assert last.status == 200
    assert last.body.startswith(first.body)
    assert last.body.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.parametrize("name", ["chat", "completions", "messages", "ollama generate"])
async def test_a_key_sent_with_another_body_is_refused_422(
    name: str, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    door = DOORS[name]
    async with serve(request_timeout=600) as served:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                _, paused, run = await gone(served, monkeypatch, door, group)
                other = Client(door.path, {**door.body, "stream": False}, KEY)
                await other.ask(served.app)
                assert run.reader is Reader.NONE  # still there to take over
                paused.release()
                await until(lambda: not runs(served))
    error_of(other, 422)


@pytest.mark.parametrize("key", ["", "k" * 256])
async def test_a_bad_key_is_refused_400(key: str, serve: Serve) -> None:
    door = DOORS["messages"]
    async with serve() as served:
        bad = Client(door.path, door.body, key)
        await bad.ask(served.app)
        longest = Client(door.path, {**door.body, "stream": False}, "k" * 255)
        await longest.ask(served.app)
        assert runs(served) == {}
    assert json.loads(error_of(bad, 400))["error"]["type"] == "invalid_request_error"
    assert longest.status == 200


async def test_with_no_retry_the_run_ends_and_its_record_is_dropped(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mlx_pinned.server")
    door = DOORS["chat"]
    async with serve(request_timeout=600) as served:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                first, paused, _ = await gone(served, monkeypatch, door, group)
                paused.release()
                await first.done.wait()
        assert runs(served) == {}
    lines = [r.getMessage() for r in caplog.records if door.path in r.getMessage()]
    (kept,) = lines  # its client left after a token; its run went on to its end
    assert " 200 " in kept
    assert "finish=length" in kept or "finish=stop" in kept
    assert not first.body.endswith(b"[DONE]\n\n")


async def test_past_the_limit_a_keyed_run_is_cancelled_as_any(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch of one keeps one run past its client: a second keyed request,
    # waiting for the turn, is cancelled when its client goes.
    door = DOORS["chat"]
    async with serve(request_timeout=600) as served:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                first, paused, _ = await gone(served, monkeypatch, door, group)
                second = Client(door.path, door.body, "another")
                group.start_soon(second.ask, served.app)
                await until(lambda: served.app.state.gate.waiting == 1)
                assert len(runs(served)) == 2
                second.leave.set()
                await second.done.wait()
                assert list(runs(served)) == [(f"POST {door.path}", KEY)]
                paused.release()
                await first.done.wait()
        assert runs(served) == {}
