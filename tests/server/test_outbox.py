"""What an answer keeps while its client reads slower than it is made: the
writer never makes a door's run wait, its bounds close a slow reader's
connection, and a shutdown ends every answer in its API's words."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from mlx_pinned.server.http.errors import shutting_down
from mlx_pinned.server.http.outbox import Outbox, ResponseWriter

from .conftest import MODEL, drive, replace_generation, sse_events, until, vision_body
from .kit import WAIT, Serve, SlowModel, post_scope, running

pytestmark = pytest.mark.anyio


class Client:
    """An ASGI ``send``: what a client read, and a client that reads nothing
    until :meth:`reads` (each write waits, as a full socket makes it)."""

    def __init__(self, *, reading: bool = True) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reading = anyio.Event()
        if reading:
            self._reading.set()

    def reads(self) -> None:
        self._reading.set()

    async def send(self, message: dict[str, Any]) -> None:
        await self._reading.wait()
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages)

    @property
    def complete(self) -> bool:
        last = self.messages[-1] if self.messages else {}
        return last.get("type") == "http.response.body" and not last["more_body"]


class Aborts:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


class TestResponseWriter:
    async def test_a_stream_is_queued_while_its_client_reads_nothing(self) -> None:
        client = Client(reading=False)
        writer = ResponseWriter(client.send, outbox=Outbox())
        with anyio.fail_after(WAIT):  # no write waits for the client
            await writer.start_stream(b"data: 0\n\n")
            for i in range(1, 100):
                await writer.send(f"data: {i}\n\n".encode())
            await writer.send(b"data: [DONE]\n\n", more=False)
        assert client.messages == []
        assert writer.kept > 0
        client.reads()
        with anyio.fail_after(WAIT):
            await writer.finish()
        assert client.complete
        events = sse_events(client.body.decode())
        assert events == [*range(100), "[DONE]"]
        assert writer.kept == writer.outbox.kept == 0

    async def test_past_its_bytes_an_answer_is_closed_and_its_run_cancelled(
        self,
    ) -> None:
        outbox, aborts = Outbox(answer_bytes=1000), Aborts()
        writer = ResponseWriter(Client(reading=False).send, outbox=outbox, abort=aborts)
        outbox.open.add(writer)
        sent = 0
        with anyio.fail_after(WAIT), anyio.CancelScope() as run:
            writer.running(run)
            await writer.start_stream(b"")
            while True:
                await writer.send(b"x" * 100)
                sent += 1
                await anyio.lowlevel.checkpoint()
        assert run.cancelled_caught
        assert sent == 11  # the 1,100th byte
        assert writer.closed is not None
        assert "--write-buffer-bytes (1000)" in writer.closed
        assert aborts.count == 1
        assert outbox.kept == writer.kept == 0  # what it kept is let go
        await writer.finish()  # nothing left to write: no wait

    async def test_past_the_total_the_stream_that_keeps_the_most_is_closed(
        self,
    ) -> None:
        outbox = Outbox(total_bytes=1000)
        most = ResponseWriter(Client(reading=False).send, outbox=outbox)
        other = ResponseWriter(Client(reading=False).send, outbox=outbox)
        outbox.open |= {most, other}
        await most.start_stream(b"x" * 600)
        await other.start_stream(b"x" * 300)
        assert most.closed is other.closed is None
        await other.send(b"x" * 200)  # 1,100 kept: the largest goes
        assert most.closed is not None
        assert "this one kept the most" in most.closed
        assert other.closed is None
        assert outbox.kept == other.kept == 500

    async def test_a_client_that_reads_nothing_for_the_write_timeout_is_closed(
        self,
    ) -> None:
        aborts = Aborts()
        outbox = Outbox(write_timeout=0.05)
        client = Client(reading=False)
        writer = ResponseWriter(client.send, outbox=outbox, abort=aborts)
        await writer.start_stream(b"data: 0\n\n")
        await writer.send(b"data: [DONE]\n\n", more=False)
        with anyio.fail_after(WAIT):
            await writer.finish()
        assert writer.closed == "its client read nothing for 0.05 s (--write-timeout)"
        assert aborts.count == 1
        assert client.messages == []

    async def test_a_whole_answer_is_written_by_finish(self) -> None:
        client = Client()
        writer = ResponseWriter(client.send, outbox=Outbox())
        await writer.json(b"{}")
        assert client.messages == []  # queued: the door writes it after its run
        await writer.finish()
        assert [m["type"] for m in client.messages] == [
            "http.response.start",
            "http.response.body",
        ]
        assert client.complete

    async def test_a_shutdown_cancels_the_runs_and_their_errors_end_the_streams(
        self,
    ) -> None:
        outbox = Outbox()
        client = Client()
        writer = ResponseWriter(client.send, outbox=outbox)
        outbox.open.add(writer)
        with anyio.fail_after(WAIT), anyio.CancelScope() as run:
            writer.running(run)
            await writer.start_stream(b"data: 0\n\n")
            await until(lambda: len(client.messages) == 2)  # the status went out
            assert outbox.end(shutting_down(), 1.0) == 1
            await anyio.sleep_forever()
        assert run.cancelled_caught
        assert writer.ending is not None
        await writer.error(writer.ending)
        await writer.finish()
        assert client.complete
        last = sse_events(client.body.decode())[-1]
        assert last["error"]["code"] == "shutting_down"


# -- through the app -----------------------------------------------------------


async def test_a_client_that_stops_reading_gives_its_turn_back_as_its_generation_ends(
    serve: Serve,
) -> None:
    # One turn of the batch: a client that reads nothing must not keep it
    # once its generation ended (before, it kept it until its deadline).
    async with serve(max_num_seqs=1) as served:
        gate = served.app.state.gate
        hold = anyio.Event()
        answers: list[tuple[int, list[bytes]]] = []

        async def stops_reading() -> None:
            body = vision_body(40, stream=True)
            answers.append(await drive(served.app, body, hold=hold))

        with anyio.fail_after(WAIT):  # a hang fails here
            async with anyio.create_task_group() as group:
                group.start_soon(stops_reading)
                await until(lambda: gate.active == 1)
                other = await served.chat(vision_body(4))
                assert other.status_code == 200
                assert answers == []  # its client still reads nothing
                hold.set()
        ((status, sent),) = answers
        assert status == 200
        events = sse_events(b"".join(sent).decode())
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> SlowModel:
    model = SlowModel(step=0.01)
    replace_generation(monkeypatch, model)
    return model


async def answer(
    app: Any, path: str, body: dict[str, Any], started: anyio.Event
) -> tuple[int, bytes, bool]:
    """The status, body and whether the body was ended (its last message
    said so) of one request driven as a server would."""
    client = Client()
    raw = json.dumps(body).encode()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        await client.send(message)
        if message["type"] == "http.response.body":
            started.set()

    await app(post_scope(path), receive, send)
    start = client.messages[0]
    return start["status"], client.body, client.complete


async def test_a_shutdown_ends_each_stream_in_its_apis_words(
    serve: Serve, slow: SlowModel, caplog: pytest.LogCaptureFixture
) -> None:
    streams = {
        "/v1/chat/completions": vision_body(4000, stream=True),
        "/v1/messages": {
            "model": MODEL,
            "max_tokens": 4000,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "/v1/responses": {
            "model": MODEL,
            "max_output_tokens": 4000,
            "stream": True,
            "input": "hi",
        },
    }
    async with serve(max_num_seqs=3) as served:
        outbox: Outbox = served.app.state.outbox
        answers: dict[str, tuple[int, bytes, bool]] = {}
        waiting: list[httpx.Response] = []

        async def ask(path: str, body: dict[str, Any], started: anyio.Event) -> None:
            answers[path] = await answer(served.app, path, body, started)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                for path, body in streams.items():
                    started = anyio.Event()
                    group.start_soon(ask, path, body, started)
                    await started.wait()

                async def queued() -> None:
                    waiting.append(await served.chat(vision_body(4)))

                group.start_soon(queued)  # the batch is full: it waits
                await until(lambda: served.app.state.gate.waiting == 1)
                assert outbox.end(shutting_down(), 1.0) == 4
    assert all(complete for _, _, complete in answers.values())
    assert all(status == 200 for status, _, _ in answers.values())
    *_, error, done = sse_events(answers["/v1/chat/completions"][1].decode())
    assert error["error"]["code"] == "shutting_down"
    assert done == "[DONE]"
    messages = answers["/v1/messages"][1].decode()
    assert messages.endswith(
        'event: error\ndata: {"type": "error", "error": {"type": "api_error", '
        '"message": "The server is shutting down."}}\n\n'
    )
    last = answers["/v1/responses"][1].decode().rsplit("event: ", 1)[1]
    kind, data = last.split("\ndata: ")
    assert kind == "response.failed"
    assert json.loads(data)["response"]["error"]["code"] == "shutting_down"
    (refused,) = waiting
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in caplog.text


# -- a real server ---------------------------------------------------------------

#: The documented bound (docs/deployment.md#clients-that-read-slowly), per
#: connection besides its answer's own buffer: the transport's 64 KiB and
#: one write; and what the model's own memory may move by meanwhile.
PER_CONNECTION = 64 * 1024 + 64 * 1024
MODEL_NOISE = 64 * 2**20


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def non_reader(url: str, body: bytes) -> socket.socket:
    """A connection that sends a streamed request and never reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


@pytest.fixture
def a_server_of_four(tmp_path: Path) -> Iterator[Any]:
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", "--demo"]
    command += ["--port", "0", "--max-tokens-limit", "20000", "--max-num-seqs", "4"]
    command += ["--write-buffer-bytes", "262144", "--write-timeout", "5"]
    with running(command, tmp_path / "server.log") as served:
        yield served


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_clients_that_never_read_hold_no_turn_and_little_memory(
    a_server_of_four: Any,
) -> None:
    server = a_server_of_four
    messages = [{"role": "user", "content": "hi"}]
    body = {
        "model": "mlx-pinned-demo",
        "messages": messages,
        "max_tokens": 20000,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT * 4) as client:
        # The same load read whole first, for what the model itself takes.
        warm = {**body, "max_tokens": 1000}

        async def read_whole() -> None:
            assert (await client.post("/v1/chat/completions", json=warm)).is_success

        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(read_whole)
        before = rss(server.process.pid)
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                peak.append(rss(server.process.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        raw = json.dumps(body).encode()
        sockets = [non_reader(server.url, raw) for _ in range(4)]
        try:
            with anyio.fail_after(WAIT):  # the four take every turn
                while (await rows(client)) < 4:  # noqa: ASYNC110 (polled state)
                    await anyio.sleep(0.05)
            # Another client is answered once one of the four is cut or ends,
            # not after the 600 s of --request-timeout.
            with anyio.fail_after(WAIT * 4):
                other = await client.post(
                    "/v1/chat/completions",
                    json={"model": "mlx-pinned-demo", "messages": messages},
                )
            assert other.status_code == 200
            with anyio.fail_after(WAIT):
                await until(lambda: len(closed(server.log_text())) == 4)
        finally:
            stop.set()
            sampler.join()
            for sock in sockets:
                sock.close()
    bound = 262144 * 4 + 4 * PER_CONNECTION + MODEL_NOISE
    print(f"RSS grew by {(max(peak) - before) / 2**20:.1f} MiB")
    assert max(peak) - before < bound, (max(peak) - before) / 2**20
    log = server.log_text()
    assert "Traceback" not in log
    assert " ERROR " not in log


async def rows(client: httpx.AsyncClient) -> int:
    models = (await client.get("/health")).json()["models"]
    count: int = models["mlx-pinned-demo"]["rows"]
    return count


def closed(log: str) -> list[str]:
    return re.findall(r"WARNING .* closed the connection of .*", log)
