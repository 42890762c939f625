"""Overload and faults: timeouts, a full queue, a dead MLX thread, a model that
raises mid-generation. Every request gets an answer, promptly, in OpenAI's
shape, and the server keeps serving."""

from __future__ import annotations

import json
import logging
from typing import Any, NoReturn

import anyio
import httpx
import pytest

from mlx_pinned.server.engine import prefills as batch_prefills
from mlx_pinned.server.engine.answers import RowAnswer
from mlx_pinned.server.engine.prompt_cache import PromptCache
from mlx_pinned.server.engine.rows import Row
from mlx_pinned.server.engine.state import BatchState

from .conftest import (
    MODEL,
    assert_error,
    drive,
    replace_generation,
    sse_events,
    until,
    vision_body,
)
from .kit import TOL, WAIT, Deadlines, Serve, Served, SlowModel, hold_until

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
        assert events[-1] == "[DONE]"  # after the error, as after a whole answer
        assert events[-2]["error"]["code"] == "timeout"
        # It streamed, then it was cut.
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert any(e["choices"][0]["delta"].get("content") for e in events[:-2])

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
            *_, last, done = sse_events(b"".join(sent).decode())
            assert last["error"]["code"] == "timeout"
            assert done == "[DONE]"
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
            *_, last, done = sse_events(chunks[-1].decode())
            assert last["error"]["code"] == "mlx_thread_unavailable"
            assert done == "[DONE]"
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
            response = await served.chat(vision_body(20))
            error = assert_error(response, 503, None, "generation_failed")
            assert error["type"] == "server_error"
            assert "injected" not in error["message"]  # no internals leak
            assert response.headers["retry-after"] == "1"

            calls[0] = 0
            response = await served.chat(vision_body(20, stream=True))
            assert response.status_code == 200
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "generation_failed"
            assert any(e["choices"][0]["delta"].get("content") for e in events[1:-2])

            monkeypatch.undo()  # the model is healthy again: so is the server
            response = await served.chat(vision_body(4))
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 4
            await settled(served)
            assert served.thread.statistics().open_streams == 0
            assert not served.thread.closed


# -- a failed step fails only the rows it touched -------------------------------

#: The ``max_tokens`` of the request an injected fault hits.
VICTIM = 7


def text_body(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        **fields,
    }


BODIES = {
    # Decoding when the fault comes (long enough to still be then).
    "a": text_body("Tell me a story.", 400, ignore_eos=True),
    "b": text_body("Count to ten.", 400, ignore_eos=True),
    # Admitted in the fault's turn: the one it hits, and one waiting to join
    # (its prompt prefilled a 32-token chunk per step, for several steps).
    "victim": text_body("Hi!", VICTIM),
    "waiting": text_body("Sum up: " + "the cat sat on the mat, " * 16, 6),
    # Sent once the victim is answered.
    "after": text_body("And now?", 5),
}


class Fault:
    """A fault injected into one step's stage: it raises once, in the first
    step of that stage that holds the victim (the row of the request whose
    ``max_tokens`` is :data:`VICTIM`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.state: BatchState | None = None
        self.victim: Row | None = None
        self.fired = 0
        self.prefilling: list[int] = []  # max_tokens of the rows it held then
        admit = BatchState.admit

        def admitting(state: BatchState, params: Any, images: Any) -> Row:
            row = admit(state, params, images)
            self.state = state
            if params.max_tokens == VICTIM:
                self.victim = row
            return row

        monkeypatch.setattr(BatchState, "admit", admitting)

    def fire(self, stage: str) -> NoReturn:
        self.fired += 1
        assert self.state is not None
        self.prefilling = [row.max_tokens for row, _ in self.state.prefilling]
        raise RuntimeError(f"injected fault in {stage}")

    def armed(self) -> bool:
        return self.victim is not None and not self.fired

    def inject(self, stage: str) -> None:
        """Make ``stage`` fail (the batch's rows decode already)."""
        state, patch = self.state, self.monkeypatch
        assert state is not None
        assert state.cache is not None
        if stage == "prefill":
            first_tokens = batch_prefills.first_tokens

            def failing_first(rows: list[Row], group: Any) -> None:
                if self.victim in rows:  # together, then alone: it fails twice
                    self.fire(stage)
                first_tokens(rows, group)

            patch.setattr(batch_prefills, "first_tokens", failing_first)
        elif stage == "lookup":
            lookup = PromptCache.lookup

            def failing_lookup(cache: PromptCache, key: Any, limit: int) -> Any:
                if self.victim is not None and key is self.victim.key:
                    self.fire(stage)
                return lookup(cache, key, limit)

            patch.setattr(PromptCache, "lookup", failing_lookup)
        elif stage == "join":
            layer = type(state.cache[0])
            extend = layer.extend

            def failing_extend(cache: Any, other: Any) -> None:
                if self.armed():
                    self.fire(stage)
                extend(cache, other)

            patch.setattr(layer, "extend", failing_extend)
        elif stage == "decode":
            model = type(state.lm)
            forward = model.__call__

            def failing_forward(lm: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
                if self.armed() and inputs.shape[1] == 1 and self.victim in state.rows:
                    self.fire(stage)
                return forward(lm, inputs, *args, **kw)

            patch.setattr(model, "__call__", failing_forward)
        else:
            read = RowAnswer.read

            def failing_read(answer: RowAnswer) -> Any:
                if answer.row is self.victim:
                    self.fire(stage)
                return read(answer)

            patch.setattr(RowAnswer, "read", failing_read)


#: The requests each stage's fault fails: a join or a decode step touches
#: the batch's rows too.
TOUCHED = {
    "prefill": {"victim"},
    "lookup": {"victim"},
    "join": {"victim", "a", "b"},
    "decode": {"victim", "a", "b"},
    "hand-out": {"victim"},
}
#: What the ERROR line names for each stage.
NAMED = {
    "prefill": "prefill",
    "lookup": "prompt cache lookup",
    "join": "join",
    "decode": "decode",
    "hand-out": "hand-out",
}
STEPPED = {
    "max_num_seqs": 8,
    "request_timeout": Deadlines.FAR,  # a hang fails the test's own deadline
    "prefill_step_size": 32,
    "prefill_step_seconds": None,
}


def chosen(response: httpx.Response) -> list[tuple[str, float]]:
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [(entry["token"], entry["logprob"]) for entry in content]


def assert_exact(ours: httpx.Response, fresh: httpx.Response) -> None:
    mine, theirs = chosen(ours), chosen(fresh)
    assert [t for t, _ in mine] == [t for t, _ in theirs]
    assert max(abs(a - b) for (_, a), (_, b) in zip(mine, theirs, strict=True)) <= TOL


class TestStepFaults:
    @pytest.mark.parametrize("stage", list(TOUCHED))
    async def test_a_fault_fails_only_the_rows_its_stage_touched(
        self,
        serve: Serve,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
        stage: str,
    ) -> None:
        untouched = [name for name in BODIES if name not in TOUCHED[stage]]
        async with serve(**STEPPED) as reference:
            fresh = {name: await reference.chat(BODIES[name]) for name in untouched}
        fault = Fault(monkeypatch)
        answers: dict[str, httpx.Response] = {}
        async with serve(**STEPPED) as served:

            async def ask(name: str) -> None:
                answers[name] = await served.chat(BODIES[name])

            loop = served.engine.loop
            caplog.set_level(logging.WARNING)
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as group:
                    group.start_soon(ask, "a")
                    group.start_soon(ask, "b")
                    await until(lambda: served.engine.statistics().active == 2)
                    fault.inject(stage)
                    # The victim, then the waiting one, admitted in one turn.
                    held = hold_until(served.thread, lambda: loop.queued() == 2)
                    group.start_soon(ask, "victim")
                    await until(lambda: loop.queued() == 1)
                    group.start_soon(ask, "waiting")
                    await anyio.to_thread.run_sync(held.result, WAIT)
                    await until(lambda: "victim" in answers)
                    group.start_soon(ask, "after")
        assert fault.fired
        if stage in ("join", "decode"):  # the waiting one: still prefilled then
            assert fault.prefilling == [BODIES["waiting"]["max_tokens"]]
        for name in TOUCHED[stage]:
            error = assert_error(answers[name], 503, None, "generation_failed")
            assert "send the request again" in error["message"]
        for name in untouched:
            assert_exact(answers[name], fresh[name])
        (line,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert NAMED[stage] in line.getMessage()
        assert "injected fault" in line.getMessage()
