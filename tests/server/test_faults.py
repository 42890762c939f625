"""Overload and faults: timeouts, a full queue, a dead MLX thread, a model that
raises mid-generation. Every request gets an answer, promptly, in OpenAI's
shape, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from .conftest import (
    assert_error,
    drive,
    replace_generation,
    sse_events,
    until,
    vision_body,
)
from .kit import WAIT, Deadlines, Serve, Served, SlowModel

pytestmark = pytest.mark.anyio


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> SlowModel:
    model = SlowModel(step=0.01)
    replace_generation(monkeypatch, model)
    return model


async def settled(served: Served) -> None:
    """Let close turns already queued on the MLX thread run (FIFO)."""
    await served.thread.run(lambda: None)


class TestTimeout:
    """Each request's deadline passes when the test says (:class:`Deadlines`),
    while the model still generates: nothing here races the clock."""

    async def test_non_streaming_is_504(
        self, serve: Serve, slow: SlowModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        deadlines = Deadlines(monkeypatch)
        async with serve(request_timeout=Deadlines.FAR) as served:
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await served.chat(vision_body(4000)))

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(ask)
                    await until(lambda: slow.made > 0)  # it generates
                    deadlines.expire()
            error = assert_error(answers[0], 504, None, "timeout")
            assert "limit of 3600 s" in error["message"]
            assert slow.made < 4000  # answered at the deadline, not at the end
            await settled(served)
            # Closed on the MLX thread, not abandoned.
            assert slow.closed == slow.started == [served.thread.ident]
            assert served.thread.statistics().open_streams == 0

    async def test_a_deadline_while_the_status_waits_still_sends_one(
        self, serve: Serve, slow: SlowModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The client reads nothing, so the status line's send waits; the
        # deadline fires there. Nothing went out: the answer is a 504 with
        # its status, not an error event in a stream that never began.
        deadlines = Deadlines(monkeypatch)
        async with serve(request_timeout=Deadlines.FAR) as served:
            stalled = anyio.Event()
            answers: list[tuple[int, list[bytes]]] = []
            body = vision_body(4000, stream=True)

            async def ask() -> None:
                answers.append(
                    await drive(served.app, body, stall_start=True, stalled=stalled)
                )

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(ask)
                    await stalled.wait()
                    deadlines.expire()
            await settled(served)
            assert slow.closed == [served.thread.ident]
        ((status, sent),) = answers
        assert status == 504
        assert json.loads(b"".join(sent))["error"]["code"] == "timeout"

    async def test_stream_gets_an_error_event(
        self, serve: Serve, slow: SlowModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        deadlines = Deadlines(monkeypatch)
        async with serve(request_timeout=Deadlines.FAR) as served:
            started = anyio.Event()
            answers: list[tuple[int, list[bytes]]] = []
            body = vision_body(4000, stream=True)

            async def ask() -> None:
                answers.append(await drive(served.app, body, started=started))

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(ask)
                    await started.wait()  # the status and a token went out
                    deadlines.expire()
            await settled(served)
            assert slow.closed == [served.thread.ident]
        ((status, sent),) = answers
        assert status == 200
        events = sse_events(b"".join(sent).decode())
        assert "[DONE]" not in events
        assert events[-1]["error"]["code"] == "timeout"
        # It streamed, then it was cut.
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert any(e["choices"][0]["delta"].get("content") for e in events[:-1])

    async def test_many_clients_queue_wait_counts(
        self, serve: Serve, slow: SlowModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The time a request waits for a slot counts toward its deadline:
        # while the test holds the only slot, every client's deadline passes
        # in the queue, and none of them starts on the MLX thread.
        deadlines = Deadlines(monkeypatch)
        async with serve(
            max_num_seqs=1, max_pending=10, request_timeout=Deadlines.FAR
        ) as served:
            gate = served.app.state.gate
            responses: list[httpx.Response] = []

            async def client(i: int) -> None:
                responses.append(await served.chat(vision_body(20, stream=i % 2 == 1)))

            with anyio.fail_after(WAIT):
                async with gate.turn(), anyio.create_task_group() as group:
                    for i in range(10):
                        group.start_soon(client, i)
                    await until(lambda: gate.waiting == 10)
                    deadlines.expire()
            assert len(responses) == 10
            for response in responses:
                assert_error(response, 504, None, "timeout")
            assert slow.started == []
            assert (gate.waiting, gate.active) == (0, 0)
            slow.release.set()
            assert (await served.chat(vision_body(2))).status_code == 200
            await settled(served)
            assert served.thread.statistics().open_streams == 0

    @pytest.mark.slow
    async def test_batched_generations_are_closed(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The CLI's default engine, the real model: three generations batched
        # together are cut at the deadline, closed and taken out of the batch.
        deadlines = Deadlines(monkeypatch)
        async with serve(max_num_seqs=32, request_timeout=Deadlines.FAR) as served:
            whole: list[httpx.Response] = []
            streamed: list[tuple[int, list[bytes]]] = []
            started = anyio.Event()

            async def ask() -> None:
                whole.append(await served.chat(vision_body(4000)))

            async def stream() -> None:
                body = vision_body(4000, stream=True)
                streamed.append(await drive(served.app, body, started=started))

            with anyio.fail_after(60):
                async with anyio.create_task_group() as group:
                    for _ in range(2):
                        group.start_soon(ask)
                    group.start_soon(stream)
                    await started.wait()
                    await until(lambda: served.engine.statistics().active == 3)
                    deadlines.expire()
            for response in whole:
                assert_error(response, 504, None, "timeout")
            ((status, sent),) = streamed
            assert status == 200
            last = sse_events(b"".join(sent).decode())[-1]
            assert last["error"]["code"] == "timeout"
            await settled(served)
            assert served.thread.statistics().open_streams == 0
            assert served.app.state.gate.active == 0
            response = await served.chat(vision_body(3))
            assert response.json()["usage"]["completion_tokens"] == 3


class TestOverload:
    async def test_many_clients_past_max_pending_get_503_at_once(
        self, serve: Serve, slow: SlowModel
    ) -> None:
        async with serve(max_pending=3) as served:
            gate = served.app.state.gate
            kept: list[httpx.Response] = []
            refused: list[httpx.Response] = []

            async def keep() -> None:
                kept.append(await served.chat(vision_body(4000)))

            async def burst() -> None:
                refused.append(await served.chat(vision_body(2)))

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(keep)  # holds the model until released
                    await until(lambda: gate.busy)
                    for _ in range(3):
                        group.start_soon(keep)  # fill the waiting room
                    await until(lambda: gate.waiting == 3)
                    async with anyio.create_task_group() as crowd:
                        for _ in range(16):
                            crowd.start_soon(burst)
                    # At once: all answered while the model is still held.
                    assert (gate.active, gate.waiting) == (1, 3)
                    slow.release.set()
            assert len(refused) == 16
            for response in refused:
                assert_error(response, 503, None, "server_busy")
                assert response.headers["retry-after"] == "1"
            assert [r.status_code for r in kept] == [200] * 4


class TestDeadThread:
    async def test_everyone_is_answered_and_health_turns_503(
        self, serve: Serve, slow: SlowModel
    ) -> None:
        async with serve() as served:
            gate = served.app.state.gate
            results: dict[str, Any] = {}
            started = anyio.Event()

            async def streaming() -> None:
                body = vision_body(4000, stream=True)
                results["stream"] = await drive(served.app, body, started=started)

            async def waiting() -> None:
                results["waiting"] = await served.chat(vision_body(2))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as group:
                    group.start_soon(streaming)
                    await started.wait()
                    group.start_soon(waiting)
                    await until(lambda: gate.waiting == 1)
                    # The thread goes away under a running stream and a queue.
                    served.thread.shutdown(wait=False, cancel_futures=True)
            status, chunks = results["stream"]
            assert status == 200
            last = json.loads(chunks[-1].removeprefix(b"data: "))
            assert last["error"]["code"] == "mlx_thread_unavailable"
            assert_error(results["waiting"], 503, None, "mlx_thread_unavailable")
            assert_error(await served.client.get("/health"), 503)
            with anyio.fail_after(WAIT):  # nothing will ever run: no wait
                error = assert_error(await served.chat(vision_body(2)), 503)
            assert "restart the server" in error["message"]
            # The thread closes the generator as it stops: wait for that.
            await anyio.to_thread.run_sync(served.thread.shutdown)
            assert slow.closed == [served.thread.ident]


class TestModelFault:
    async def test_a_model_that_raises_mid_generation(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with serve() as served:
            cls = type(served.model.model.language_model)
            original = cls.__call__
            calls = [0]

            def faulty(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                if calls[0] >= 4:
                    raise RuntimeError("injected fault in the language model")
                return original(self, *args, **kwargs)

            monkeypatch.setattr(cls, "__call__", faulty)
            error = assert_error(await served.chat(vision_body(20)), 500)
            assert error["type"] == "server_error"
            assert "injected" not in error["message"]  # no internals leak

            calls[0] = 0
            response = await served.chat(vision_body(20, stream=True))
            assert response.status_code == 200
            events = sse_events(response.text)
            assert "[DONE]" not in events
            assert events[-1]["error"]["type"] == "server_error"
            assert any(e["choices"][0]["delta"].get("content") for e in events[1:-1])

            monkeypatch.undo()  # the model is healthy again: so is the server
            response = await served.chat(vision_body(4))
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 4
            await settled(served)
            assert served.thread.statistics().open_streams == 0
            assert not served.thread.closed
