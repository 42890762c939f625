from __future__ import annotations

import asyncio
import base64
import gc
import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from mlx_pinned import _waiters
from mlx_pinned.server import ImageLimits
from mlx_pinned.server.engine import LoadedModel, driver, model_inputs
from mlx_pinned.server.engine.driver import RowOutput
from mlx_pinned.server.engine.loop import BatchLoop
from mlx_pinned.server.events import FinalEvent, GenerationParams, TokenEvent
from mlx_pinned.testing import image_data_uri

from .conftest import (
    MODEL,
    AtOnce,
    assert_error,
    drive,
    replace_generation,
    sse_events,
    until,
    vision_body,
)
from .kit import (
    WAIT,
    Serve,
    Served,
    content_of,
    hold_until,
    logprobs,
    mlx_thread_held,
    post_scope,
)

pytestmark = pytest.mark.anyio


class Chunks:
    """A request body sent to the app in parts (chunked, no content-length),
    straight through ASGI: httpx wraps a streamed body in an async generator
    that a refused request leaves unfinished, and trio then warns whenever the
    garbage collector gets to it, in whichever test is running."""

    def __init__(self, *parts: bytes) -> None:
        self._parts = list(parts)
        self.messages: list[dict[str, Any]] = []

    @property
    def left(self) -> int:
        return len(self._parts)

    async def post(self, served: Served, path: str) -> httpx.Response:
        await served.app(post_scope(path, served.state), self._receive, self._send)
        start, *bodies = self.messages
        return httpx.Response(
            start["status"],
            headers=start["headers"],
            content=b"".join(m.get("body", b"") for m in bodies),
        )

    async def _receive(self) -> dict[str, Any]:
        if not self._parts:
            return {"type": "http.disconnect"}
        body = self._parts.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(self._parts)}

    async def _send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)


class Lockstep:
    """The batch's loop steps again only once its reader took what the last
    step handed out, or left (the MLX thread waits for the event loop), so
    tokens reach the reader one at a time however loaded the machine is;
    past ``tokens`` tokens (None: never) the loop runs freely again."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, tokens: int | None = None
    ) -> None:
        self.taken = threading.Semaphore(0)
        self.owed = False  # a step handed out a token not yet taken
        self.steps_after_a_token = 0
        self.waited_out = False
        turn, take = BatchLoop.turn, RowOutput.take

        def stepping(loop: BatchLoop) -> Any:
            stepped = tokens is None or self.steps_after_a_token <= tokens
            if self.owed and stepped and not self.waited_out:
                self.waited_out = not self.taken.acquire(timeout=WAIT)
            self.owed = False
            outputs = turn(loop)
            items = (item for _, given, _ in outputs for item in given)
            self.owed = any(isinstance(item, TokenEvent) for item in items)
            self.steps_after_a_token += self.owed
            return outputs

        async def taking(output: RowOutput, n: int, least: int | None = None) -> Any:
            events = await take(output, n, least)
            if events:
                self.taken.release()
            return events

        leave = BatchLoop.leave

        def leaving(loop: BatchLoop, request: Any) -> None:
            leave(loop, request)
            self.taken.release()

        monkeypatch.setattr(BatchLoop, "turn", stepping)
        monkeypatch.setattr(RowOutput, "take", taking)
        monkeypatch.setattr(BatchLoop, "leave", leaving)


class Interval:
    """The stream writer's wait for its interval, ended by the test
    (:meth:`over`) instead of by the clock; records the waits asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked: list[float] = []
        self._over = anyio.Event()
        monkeypatch.setattr(driver, "anyio", self)

    def __getattr__(self, name: str) -> Any:
        return getattr(anyio, name)

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self._over.wait()

    def over(self) -> None:
        self._over.set()


class TestRoutes:
    async def test_health(self, serve: Serve) -> None:
        async with serve() as served:
            response = await served.client.get("/health")
            assert response.status_code == 200
            assert response.json()["status"] == "ok"
            served.thread.shutdown()
            assert_error(await served.client.get("/health"), 503)

    async def test_health_tells_each_models_rows_and_kv(self, serve: Serve) -> None:
        async with serve() as served:
            idle = (await served.client.get("/health")).json()["models"]
            nothing = {"rows": 0, "kv_bytes": 0, "kv_bytes_per_token": 0}
            assert idle == {MODEL: {"loaded": True, **nothing}}
            started, leave = anyio.Event(), anyio.Event()
            body = vision_body(4000, stream=True)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as group:
                    group.start_soon(
                        partial(drive, started=started, leave=leave), served.app, body
                    )
                    await started.wait()  # its row decodes
                    async with mlx_thread_held(served.thread):  # and stays
                        health = await served.client.get("/health")
                    leave.set()
        seen = health.json()["models"][MODEL]
        assert seen["rows"] == 1
        assert seen["kv_bytes"] > 0
        assert seen["kv_bytes_per_token"] > 0

    async def test_models(self, serve: Serve) -> None:
        async with serve() as served:
            listing = (await served.client.get("/v1/models")).json()
            assert listing["object"] == "list"
            assert [m["id"] for m in listing["data"]] == [MODEL]
            card = (await served.client.get(f"/v1/models/{MODEL}")).json()
            assert card["object"] == "model"
            assert card["owned_by"] == "mlx-pinned"
            # When the model was loaded: the same at every call (it was now
            # minus the load's duration, moving with the clock).
            loaded_at = int(served.engine.loaded_at)
            assert listing["data"][0]["created"] == card["created"] == loaded_at
            missing = await served.client.get("/v1/models/gpt-4o")
            assert_error(missing, 404, "model", "model_not_found")

    async def test_unknown_url_and_method(self, serve: Serve) -> None:
        async with serve() as served:
            error = assert_error(await served.client.get("/v2/nothing"), 404)
            assert error["type"] == "invalid_request_error"
            response = await served.client.get("/v1/chat/completions")
            error = assert_error(response, 405)
            assert "GET" in error["message"]
            assert response.headers["allow"] == "POST"  # RFC 9110: a 405 has one


class TestCompletion:
    async def test_bug_report_request(self, serve: Serve) -> None:
        async with serve() as served:
            response = await served.chat(vision_body(max_tokens=80))
            assert response.status_code == 200
            # Sent whole, so framed by its length, not chunked.
            assert response.headers["content-length"] == str(len(response.content))
            body = response.json()
            assert body["id"].startswith("chatcmpl-")
            assert body["object"] == "chat.completion"
            assert body["model"] == MODEL
            assert isinstance(body["created"], int)
            (choice,) = body["choices"]
            assert choice["index"] == 0
            assert choice["message"]["role"] == "assistant"
            assert choice["message"]["content"]
            assert choice["finish_reason"] == "length"
            assert choice["logprobs"] is None
            usage = body["usage"]
            assert usage["completion_tokens"] == 80
            assert usage["prompt_tokens"] > 10
            assert usage["total_tokens"] == usage["prompt_tokens"] + 80

    async def test_default_and_limit_of_max_tokens(self, serve: Serve) -> None:
        async with serve(max_tokens_limit=20, default_max_tokens=6) as served:
            body = vision_body()
            del body["max_tokens"]
            usage = (await served.chat(body)).json()["usage"]
            assert usage["completion_tokens"] == 6
            error = assert_error(await served.chat(vision_body(21)), 400, "max_tokens")
            assert "21" in error["message"]
            assert "20" in error["message"]
            too_many = vision_body(max_completion_tokens=50)
            assert_error(await served.chat(too_many), 400, "max_completion_tokens")

    async def test_logprobs(self, serve: Serve) -> None:
        async with serve() as served:
            body = (
                await served.chat(vision_body(6, logprobs=True, top_logprobs=3))
            ).json()
            content = body["choices"][0]["logprobs"]["content"]
            assert len(content) == 6
            for item in content:
                assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
                assert len(item["top_logprobs"]) == 3
                assert item["top_logprobs"][0]["token"] == item["token"]
            text = b"".join(bytes(i["bytes"]) for i in content).decode()
            assert text == body["choices"][0]["message"]["content"]

    async def test_stop_string(self, serve: Serve) -> None:
        async with serve() as served:
            full = (await served.chat(vision_body(20))).json()
            text = full["choices"][0]["message"]["content"]
            stop = text[4:7]
            body = (await served.chat(vision_body(20, stop=stop))).json()
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["choices"][0]["message"]["content"] == text[: text.index(stop)]
            assert body["usage"]["completion_tokens"] < 20

    async def test_end_of_turn(self, serve: Serve) -> None:
        async with serve() as served:
            im_end = served.model.tokenizer.convert_tokens_to_ids("<|im_end|>")
            bias = {str(im_end): 100}
            body = (await served.chat(vision_body(20, logit_bias=bias))).json()
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["choices"][0]["message"]["content"] == ""
            assert body["usage"]["completion_tokens"] == 0

    async def test_seed(self, serve: Serve) -> None:
        async with serve() as served:

            async def sample(seed: int) -> str:
                body = vision_body(16, temperature=1.5, seed=seed)
                response = (await served.chat(body)).json()
                return str(response["choices"][0]["message"]["content"])

            assert await sample(3) == await sample(3)
            assert len({await sample(s) for s in range(4)}) > 1

    async def test_text_only(self, serve: Serve) -> None:
        async with serve() as served:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            response = await served.chat({**body, "max_tokens": 3})
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 3

    async def test_top_p_is_honoured(self, serve: Serve) -> None:
        async with serve() as served:

            async def text(**fields: Any) -> str:
                body = (await served.chat(vision_body(12, **fields))).json()
                return str(body["choices"][0]["message"]["content"])

            greedy = await text()
            # A nucleus of one token samples the most likely token at any seed.
            for seed in range(3):
                assert await text(temperature=1.5, top_p=1e-6, seed=seed) == greedy
            assert await text(temperature=1.5, seed=0) != greedy
            # Under float32's smallest number it was 0 there: nothing was kept,
            # and the answer was empty ("stop" at once).
            assert await text(temperature=1.5, top_p=1e-46, seed=0) == greedy

    async def test_multi_turn_several_images(self, serve: Serve) -> None:
        async with serve() as served:
            first = vision_body(2)["messages"][0]
            body = vision_body(
                2,
                messages=[
                    {"role": "system", "content": "Be brief."},
                    first,
                    {"role": "assistant", "content": "A picture."},
                    {**first, "content": [*first["content"], *first["content"]]},
                ],
            )
            usage = (await served.chat(body)).json()["usage"]
            single = (await served.chat(vision_body(2))).json()["usage"]
            assert usage["prompt_tokens"] >= single["prompt_tokens"] + 3 * 4

    @pytest.mark.parametrize("max_num_seqs", [1, 4])
    async def test_a_whole_response_wakes_the_event_loop_once(
        self, serve: Serve, max_num_seqs: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Not once per token: the events reach the loop in one batch (and
        # the prompt's acceptance, which settles its charge, before them).
        wakes: list[str] = []
        wake = _waiters.LoopWaiter.wake

        def counting(self: _waiters.LoopWaiter) -> None:
            wakes.append(threading.current_thread().name)
            wake(self)

        monkeypatch.setattr(_waiters.LoopWaiter, "wake", counting)
        asked = threading.Event()
        whole = BatchLoop.whole

        def asking(self: BatchLoop, request: Any) -> None:
            whole(self, request)
            asked.set()

        monkeypatch.setattr(BatchLoop, "whole", asking)
        config = {"max_num_seqs": max_num_seqs, "stream_write_interval": 0}
        async with serve(**config) as served:
            await served.chat(vision_body(2))  # warm: the batch engine is made
            asked.clear()
            # The loop's first turn waits until the answer is asked for
            # whole: else its first token may go out alone, as it would for
            # any reader that had not said yet.
            held = hold_until(served.thread, asked.is_set)
            wakes.clear()
            response = await served.chat(vision_body(24))
            held.result(0)
            assert response.json()["usage"]["completion_tokens"] == 24
        assert len(wakes) <= 3, wakes

    @pytest.mark.parametrize("max_num_seqs", [1, 4])
    async def test_a_stream_is_written_as_its_tokens_come(
        self, serve: Serve, max_num_seqs: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The loop steps again only once the reader took the last token, so
        # each token is read (and written) before the next is made: a writer
        # that held tokens back would leave the loop waiting.
        lockstep = Lockstep(monkeypatch)
        config = {"max_num_seqs": max_num_seqs, "stream_write_interval": 0}
        async with serve(**config) as served:
            # Log-probabilities make every token an event, empty text or not.
            body = vision_body(24, stream=True, logprobs=True)
            with anyio.fail_after(60):
                status, sent = await drive(served.app, body)
        assert status == 200
        assert not lockstep.waited_out, "a token was not read before the next step"
        assert lockstep.steps_after_a_token == 24
        # The role chunk once the prompt was taken, a write a token, the tail.
        assert len(sent) == 1 + 24 + 1
        assert all(len(sse_events(m.decode())) == 1 for m in sent[:-1])
        assert sse_events(sent[-1].decode())[-1] == "[DONE]"

    @pytest.mark.parametrize("stream", [False, True])
    async def test_log_line(
        self, serve: Serve, caplog: pytest.LogCaptureFixture, stream: bool
    ) -> None:
        caplog.set_level(logging.INFO, "mlx_pinned.server")
        async with serve() as served:
            response = await served.chat(vision_body(12, stream=stream))
            assert response.status_code == 200
        (line,) = [r.getMessage() for r in caplog.records if "completion=" in r.message]
        match = re.fullmatch(
            r"127\.0\.0\.1:\d+ POST /v1/chat/completions 200 stream=(\d) images=1 "
            r"prompt=\d+ completion=12 queue=[\d.]+ms ttft=([\d.]+)ms "
            r"total=([\d.]+)ms ([\d.]+) tok/s finish=length model=tiny",
            line,
        )
        assert match, line
        assert match[1] == str(int(stream))
        ttft, total, rate = (float(match[i]) for i in (2, 3, 4))
        # Also when the tokens reach the event loop together, at the end.
        assert 0 < ttft < total
        assert rate > 0

    async def test_freeze_gc_after_the_model_loads(
        self, serve: Serve, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="mlx_pinned.server")
        assert gc.get_freeze_count() == 0
        try:
            async with serve(freeze_gc=True) as served:
                frozen = [r for r in caplog.records if "froze" in r.getMessage()]
                assert len(frozen) == 1
                assert served.engine is not None  # frozen after the load
                # The libraries and the model: some of them die later.
                count = int(frozen[0].getMessage().split()[1])
                assert count >= gc.get_freeze_count() > 10_000
                response = await served.chat(vision_body(4))
                assert response.json()["usage"]["completion_tokens"] == 4
        finally:
            gc.unfreeze()


class TestStreaming:
    async def test_stream_shape(self, serve: Serve) -> None:
        async with serve() as served:
            response = await served.chat(vision_body(8, stream=True))
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert len({c["id"] for c in chunks}) == 1
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert all("usage" not in c for c in chunks)
            assert chunks[0]["choices"][0]["delta"] == {
                "role": "assistant",
                "content": "",
            }
            assert chunks[-1]["choices"][0]["delta"] == {}
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
            plain = (await served.chat(vision_body(8))).json()
            assert content_of(chunks) == plain["choices"][0]["message"]["content"]

    async def test_include_usage(self, serve: Serve) -> None:
        async with serve() as served:
            body = vision_body(5, stream=True, stream_options={"include_usage": True})
            chunks = sse_events((await served.chat(body)).text)[:-1]
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == []
            assert chunks[-1]["usage"]["completion_tokens"] == 5

    @pytest.mark.parametrize("max_num_seqs", [1, 4])
    async def test_stream_writes(self, serve: Serve, max_num_seqs: int) -> None:
        # With no interval, a body message (a socket write) per wake-up, its
        # tokens' text as one chunk; the role chunk goes first, alone, once
        # the prompt was taken, and finish, usage and [DONE] end the response
        # in one message.
        config = {"max_num_seqs": max_num_seqs, "stream_write_interval": 0}
        async with serve(**config) as served:
            body = vision_body(6, stream=True, stream_options={"include_usage": True})
            with anyio.fail_after(20):
                status, sent = await drive(served.app, body)
            plain = (await served.chat(vision_body(6))).json()
        assert status == 200
        assert 3 <= len(sent) <= 8  # the role, 6 tokens, the tail; empty texts skip
        (role,) = sse_events(sent[0].decode())
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        last = sse_events(sent[-1].decode())
        assert last[-1] == "[DONE]"
        assert last[-2]["usage"]["completion_tokens"] == 6
        assert last[-3]["choices"][0]["finish_reason"] == "length"
        assert all(len(sse_events(m.decode())) == 1 for m in sent[1:-1])
        chunks = [c for m in sent for c in sse_events(m.decode())]
        assert content_of(chunks) == plain["choices"][0]["message"]["content"]

    async def test_stream_write_interval(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Tokens that come within the interval go out together: the first
        # write at once, the rest once the interval is over. The first token
        # is read alone, and the interval ends once the whole answer is in.
        Lockstep(monkeypatch, tokens=1)
        interval = Interval(monkeypatch)
        routed: list[bool] = []  # the answer's end reached its reader's output
        put = RowOutput.put

        def routing(output: RowOutput, items: Any, *, gone: bool) -> None:
            put(output, items, gone=gone)
            routed.append(any(isinstance(item, FinalEvent) for item in items))

        monkeypatch.setattr(RowOutput, "put", routing)
        async with serve(stream_write_interval=1.0) as served:
            body = vision_body(12, stream=True, stream_options={"include_usage": True})
            started = anyio.Event()
            answers: list[tuple[int, list[bytes]]] = []

            async def stream() -> None:
                answers.append(await drive(served.app, body, started=started))

            with anyio.fail_after(60):
                async with anyio.create_task_group() as group:
                    group.start_soon(stream)
                    await started.wait()
                    await until(lambda: any(routed))
                    interval.over()
            plain = (await served.chat(vision_body(12))).json()
        ((status, sent),) = answers
        assert status == 200
        # Each wait is what was left of the interval since the last write.
        assert interval.asked
        assert all(0 < wait <= 1.0 for wait in interval.asked)
        # The role chunk; the first token; the other tokens, one chunk of
        # their joined text; finish, usage and [DONE].
        assert len(sent) == 4
        role, first, rest, last = (sse_events(m.decode()) for m in sent)
        assert role[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(first) == len(rest) == 1
        assert last[-2]["usage"]["completion_tokens"] == 12
        whole = plain["choices"][0]["message"]["content"]
        assert content_of([*role, *first, *rest, *last]) == whole

    async def test_stream_logprobs_match_non_streamed(self, serve: Serve) -> None:
        async with serve() as served:
            body = vision_body(6, logprobs=True, top_logprobs=2)
            plain = (await served.chat(body)).json()["choices"][0]["logprobs"][
                "content"
            ]
            events = sse_events((await served.chat({**body, "stream": True})).text)
            streamed = [
                item
                for e in events[:-1]
                if e["choices"] and e["choices"][0]["logprobs"]
                for item in e["choices"][0]["logprobs"]["content"]
            ]
            assert streamed == plain

    async def test_stop_in_stream(self, serve: Serve) -> None:
        async with serve() as served:
            text = content_of(
                sse_events((await served.chat(vision_body(20, stream=True))).text)
            )
            stop = text[6:9]
            events = sse_events(
                (await served.chat(vision_body(20, stream=True, stop=[stop]))).text
            )
            assert content_of(events) == text[: text.index(stop)]
            assert events[-2]["choices"][0]["finish_reason"] == "stop"


def image_message(url: Any) -> dict[str, Any]:
    body = vision_body(2)
    body["messages"][0]["content"][1] = {"type": "image_url", "image_url": url}
    return body


class TestRequestErrors:
    async def test_validation_errors_name_the_param(self, serve: Serve) -> None:
        async with serve() as served:
            assert_error(await served.chat(b"{nope"), 400, None, "invalid_json")
            assert_error(await served.chat({"model": MODEL}), 400, "messages")
            assert_error(
                await served.chat(vision_body(temperature=3)), 400, "temperature"
            )
            assert_error(await served.chat(vision_body(n=2)), 400, "n")
            assert_error(await served.chat(image_message(5)), 400, PARAM)

    async def test_unknown_model_is_404(self, serve: Serve) -> None:
        async with serve() as served:
            error = assert_error(
                await served.chat(vision_body(model="gpt-4o")),
                404,
                "model",
                "model_not_found",
            )
            assert "gpt-4o" in error["message"]

    @pytest.mark.parametrize(
        ("url", "code"),
        [
            ("data:image/jpeg;base64,!!!", "invalid_base64"),
            (
                "data:image/jpeg;base64," + base64.b64encode(b"not an image").decode(),
                "invalid_image",
            ),
            ("file:///etc/passwd", "invalid_image_url"),
            ("/etc/passwd", "invalid_image_url"),
            ("http://127.0.0.1/cat.png", "remote_images_disabled"),
        ],
    )
    async def test_bad_images_are_400(self, serve: Serve, url: str, code: str) -> None:
        async with serve() as served:
            assert_error(
                await served.chat(image_message({"url": url})), 400, PARAM, code
            )

    async def test_image_limits(self, serve: Serve) -> None:
        limits = ImageLimits(max_images=1, max_pixels=32 * 32)
        async with serve(image_limits=limits) as served:
            assert_error(
                await served.chat(vision_body()), 400, PARAM, "image_too_large"
            )
            body = vision_body()
            body["messages"][0]["content"].insert(0, body["messages"][0]["content"][1])
            extra = "messages[0].content[2].image_url"  # the first image too many
            assert_error(await served.chat(body), 400, extra, "too_many_images")

    async def test_logit_bias_outside_vocabulary(self, serve: Serve) -> None:
        async with serve() as served:
            body = vision_body(logit_bias={"100000": 1})
            assert_error(await served.chat(body), 400, "logit_bias")

    async def test_body_too_large_is_413(self, serve: Serve) -> None:
        async with serve(max_body_bytes=1000) as served:
            assert_error(
                await served.chat(vision_body()), 413, None, "request_too_large"
            )

            # No content-length; the server stops reading past its limit.
            chunks = Chunks(b'{"model": "tiny", "messages": [', b" " * 4000)
            response = await chunks.post(served, "/v1/chat/completions")
            assert_error(response, 413)
            assert chunks.left == 0  # the second part was sent, and refused

    async def test_api_key(self, serve: Serve) -> None:
        async with serve(api_key="s3cret") as served:
            assert (await served.client.get("/health")).status_code == 200
            assert_error(
                await served.client.get("/v1/models"), 401, None, "invalid_api_key"
            )
            wrong = {"Authorization": "Bearer nope"}
            assert_error(await served.chat(vision_body(), headers=wrong), 401)
            right = {"Authorization": "Bearer s3cret"}
            assert (await served.chat(vision_body(), headers=right)).status_code == 200
            # The scheme is case-insensitive (RFC 9110); the key is not.
            for given in ("bearer s3cret", "Bearer   s3cret", "BEARER s3cret "):
                headers = {"Authorization": given}
                assert (
                    await served.chat(vision_body(), headers=headers)
                ).status_code == 200
            for given in (
                "Bearer S3CRET",
                "Bearer",
                "Bearer ",
                "s3cret",
                "Basic s3cret",
            ):
                headers = {"Authorization": given}
                assert_error(await served.chat(vision_body(), headers=headers), 401)

    @pytest.mark.parametrize("size", [(300, 1), (2, 1000)])
    async def test_images_the_processor_would_refuse_are_400(
        self, serve: Serve, size: tuple[int, int]
    ) -> None:
        # Qwen-VL's processor raises on sides over 200:1 (a 500 before).
        async with serve() as served:
            url = image_data_uri(*size, fmt="PNG")
            error = assert_error(
                await served.chat(image_message({"url": url})),
                400,
                PARAM,
                "invalid_image",
            )
            assert "200 times" in error["message"]
            url = image_data_uri(400, 2, fmt="PNG")  # 200:1, the most allowed
            assert (await served.chat(image_message({"url": url}))).status_code == 200


PARAM = "messages[0].content[1].image_url"


def failing_generate(after: int) -> Any:
    def generate(
        loaded: LoadedModel, params: GenerationParams, images: Any
    ) -> Iterator[TokenEvent | FinalEvent]:
        for _ in range(after):
            yield TokenEvent("x")
        raise RuntimeError("injected failure")

    return generate


class TestFailures:
    async def test_failure_before_first_token_is_500(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with serve() as served:
            replace_generation(monkeypatch, failing_generate(0))
            for stream in (False, True):
                error = assert_error(await served.chat(vision_body(stream=stream)), 500)
                assert error["type"] == "server_error"
                assert "injected" not in error["message"]  # no internals leak

    async def test_failure_mid_stream_is_an_error_event(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with serve() as served:
            replace_generation(monkeypatch, failing_generate(3))
            response = await served.chat(vision_body(stream=True))
            assert response.status_code == 200
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert set(events[-2]) == {"error"}
            assert events[-2]["error"]["type"] == "server_error"
            assert content_of(events[:-2]) == "xxx"
            assert_error(await served.chat(vision_body()), 500)
            monkeypatch.undo()
            # The server keeps serving.
            assert (await served.chat(vision_body())).status_code == 200
            assert served.thread.statistics().open_streams == 0


class TestPlacement:
    async def test_where_each_piece_runs(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from mlx_pinned.server.inputs import images

        seen: dict[str, set[int]] = {"decode": set(), "prompt": set()}
        decode, build_prompt = images.decode_image, model_inputs.build_prompt

        def spy_decode(*args: Any, **kwargs: Any) -> Any:
            seen["decode"].add(threading.get_ident())
            return decode(*args, **kwargs)

        def spy_prompt(*args: Any, **kwargs: Any) -> str:
            seen["prompt"].add(threading.get_ident())
            return build_prompt(*args, **kwargs)

        monkeypatch.setattr(images, "decode_image", spy_decode)
        monkeypatch.setattr(model_inputs, "build_prompt", spy_prompt)
        async with serve() as served:
            body = vision_body(2)
            body["messages"][0]["content"][1]["image_url"]["url"] = image_data_uri(
                fmt="PNG"
            )
            assert (await served.chat(body)).status_code == 200
            mlx = served.thread.ident
        loop = threading.get_ident()
        assert seen["prompt"] == {mlx}
        assert seen["decode"]
        assert not seen["decode"] & {mlx, loop}

    async def test_at_most_a_decode_per_core_at_once(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from mlx_pinned.server.inputs import images

        monkeypatch.setattr(os, "cpu_count", lambda: 1)
        decodes = AtOnce(0.01)
        monkeypatch.setattr(images, "decode_image", decodes.wrap(images.decode_image))
        statuses: list[int] = []
        async with serve(max_num_seqs=4) as served:

            async def one() -> None:
                statuses.append((await served.chat(vision_body(2))).status_code)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as group:
                    for _ in range(4):
                        group.start_soon(one)
        assert statuses == [200] * 4
        assert decodes.most == 1


class TestSerialisation:
    @pytest.mark.slow
    async def test_logprobs_alone_equal_logprobs_among_16(self, serve: Serve) -> None:
        greedy = vision_body(40, logprobs=True, top_logprobs=2)

        async with serve() as served:
            alone = logprobs(await served.chat(greedy))
            crowd: list[float] = []

            async def other(i: int) -> None:
                body = vision_body(
                    10 + i,
                    image_seed=i + 1,
                    # Other image shapes give other mRoPE state on the model.
                    image_size=(32 + 16 * (i % 6), 128 - 16 * (i % 5)),
                    prompt="x" * (i + 1),
                    stream=bool(i % 2),
                )
                response = await served.chat(body)
                assert response.status_code == 200

            async def target() -> None:
                crowd.extend(logprobs(await served.chat(greedy)))

            async with anyio.create_task_group() as group:
                group.start_soon(target)
                # Once it generates, 16 different requests arrive: run
                # interleaved, their prefills would overwrite its model state.
                await until(lambda: served.thread.statistics().open_streams > 0)
                for i in range(16):
                    group.start_soon(other, i)
        assert len(crowd) == len(alone) == 40
        assert crowd == pytest.approx(alone, abs=1e-5)

    async def test_full_waiting_room_is_503(self, serve: Serve) -> None:
        async with serve(max_pending=1) as served:
            gate = served.app.state.gate
            resume = anyio.Event()
            results: dict[str, Any] = {}

            async def slow_reader() -> None:
                body = vision_body(20, stream=True)
                results["a"] = await drive(served.app, body, hold=resume)

            async def queued() -> None:
                results["b"] = await served.chat(vision_body(2))

            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    group.start_soon(slow_reader)  # holds the model, reads slowly
                    await until(lambda: gate.busy)
                    group.start_soon(queued)
                    await until(lambda: gate.waiting == 1)
                    busy = await served.chat(vision_body(2))
                    resume.set()
            error = assert_error(busy, 503, None, "server_busy")
            assert busy.headers["retry-after"] == "1"
            assert "retry" in error["message"]
            assert results["a"][0] == 200
            assert results["b"].status_code == 200
            assert (await served.chat(vision_body(2))).status_code == 200


class TestDisconnect:
    async def test_disconnect_mid_stream_closes_the_generator(
        self,
        serve: Serve,
        caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        caplog.set_level(logging.INFO, "mlx_pinned.server")
        # A token at a time: the writer always waits for the next one, and
        # its client's leaving reaches it there, whatever the load.
        Lockstep(monkeypatch)
        async with serve() as served:
            before = served.thread.statistics()
            body = vision_body(2000, stream=True)
            with anyio.fail_after(10):
                status, sent = await drive(served.app, body, disconnect_after=3)
            after = served.thread.statistics()
            assert status == 200
            assert len(sent) <= 4  # stopped within a token of leaving
            # The request ends once the loop took its row out: the loop had
            # no other row, so its stream ended too, as a finished one.
            assert after.open_streams == 0
            assert after.completed > before.completed
            assert after.failed == before.failed
            assert "client disconnected" in caplog.text
            # The model is free again at once.
            assert (await served.chat(vision_body(2))).status_code == 200

    @pytest.mark.parametrize("max_num_seqs", [1, 4])
    async def test_disconnect_during_a_whole_answer_closes_the_generator(
        self, serve: Serve, max_num_seqs: int
    ) -> None:
        # A non-streamed answer waits for its batch of events, not per token:
        # the client leaving still closes the generation on the thread.
        async with serve(max_num_seqs=max_num_seqs) as served:
            before = served.thread.statistics()
            leave = anyio.Event()

            made = served.engine.statistics().decoded_tokens

            async def leave_once_generating() -> None:
                # Some tokens in: the answer is waited for, not yet whole.
                await until(lambda: served.engine.statistics().decoded_tokens > made)
                leave.set()

            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    group.start_soon(leave_once_generating)
                    status, sent = await drive(
                        served.app, vision_body(4000), leave=leave
                    )
            after = served.thread.statistics()
            assert (status, sent) == (0, [])  # nothing was answered
            assert after.open_streams == 0  # the row left, the loop stopped
            assert after.completed > before.completed
            assert after.failed == before.failed
            assert served.app.state.gate.active == 0
            assert (await served.chat(vision_body(2))).status_code == 200

    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_the_disconnect_watcher_ends_with_its_request(
        self, serve: Serve
    ) -> None:
        # On asyncio the watcher is a bare task: the request must stop it,
        # even though this client keeps its connection open and silent.
        body = json.dumps(vision_body(2)).encode()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if not sent and not received:
                received.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await anyio.sleep_forever()
            raise AssertionError  # pragma: no cover

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        def watchers() -> list[asyncio.Task[Any]]:
            return [
                t
                for t in asyncio.all_tasks()
                if "watch_disconnect" in repr(t.get_coro()) and not t.done()
            ]

        async with serve() as served:
            for _ in range(2):
                received: list[bool] = []
                sent.clear()
                scope = post_scope("/v1/chat/completions", served.state)
                with anyio.fail_after(10):
                    await served.app(scope, receive, send)
                    assert sent[0]["status"] == 200
                    await until(lambda: not watchers())

    @pytest.mark.slow
    async def test_disconnect_while_waiting_never_starts(self, serve: Serve) -> None:
        async with serve() as served:
            gate = served.app.state.gate
            before = served.thread.statistics()
            results: dict[str, Any] = {}
            leave = anyio.Event()

            async def long_one() -> None:
                results["long"] = await drive(served.app, vision_body(300, stream=True))

            async def impatient() -> None:
                results["impatient"] = await drive(
                    served.app, vision_body(5), leave=leave
                )

            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    group.start_soon(long_one)
                    await until(lambda: gate.busy)
                    group.start_soon(impatient)
                    await until(lambda: gate.waiting == 1)
                    leave.set()  # the impatient client leaves while queued
            after = served.thread.statistics()
            assert results["long"][0] == 200
            assert results["impatient"] == (0, [])
            assert gate.waiting == 0
            # Only the long stream ever ran on the thread.
            ended = after.completed + after.cancelled + after.failed
            assert ended - (before.completed + before.cancelled + before.failed) == 1


@pytest.mark.parametrize(
    "options",
    [
        {"max_pending": 0},
        {"max_prompt_tokens": 0},
        {"request_timeout": 0},
        {"request_timeout": float("nan")},
        {"remote_image_timeout": 0},
        {"api_key": ""},  # "Authorization: Bearer " with nothing after it passed
    ],
)
def test_invalid_options(options: dict[str, Any]) -> None:
    from mlx_pinned.server import create_app

    with pytest.raises(ValueError, match=next(iter(options))):
        create_app("unused", **options)
