"""Prompt-length limits: a 400 that gives the numbers, before any prefill."""

from __future__ import annotations

import types
from typing import Any

import pytest

from mlx_pinned.server.engine import LoadedModel
from mlx_pinned.server.failures import PromptTooLongError
from mlx_pinned.server.http.errors import api_error
from mlx_pinned.server.limits import (
    check_text_length,
    context_length,
    longest_token_chars,
    max_tokens_for,
)

from .conftest import MODEL, assert_error, vision_body
from .kit import Serve


class TestChecks:
    def test_context_length_from_config(self) -> None:
        text = types.SimpleNamespace(max_position_embeddings=4096)
        assert context_length(types.SimpleNamespace(text_config=text)) == 4096
        top = types.SimpleNamespace(max_position_embeddings=2048, text_config=None)
        assert context_length(top) == 2048
        assert context_length({"max_position_embeddings": 77}) == 77
        assert context_length(types.SimpleNamespace()) is None

    def test_prompt_tokens(self) -> None:
        assert max_tokens_for(100, 28, max_prompt_tokens=100, context=128) == 28
        with pytest.raises(PromptTooLongError) as over:
            max_tokens_for(101, 1, max_prompt_tokens=100, context=None)
        assert "101" in over.value.message
        assert "100" in over.value.message
        assert (over.value.prompt_tokens, over.value.limit) == (101, 100)
        answer = api_error(over.value, retry_after=1)
        assert answer is not None
        assert (answer.status, answer.param) == (400, "messages")
        assert answer.code == "context_length_exceeded"

    def test_max_tokens_are_cut_to_what_the_context_leaves(self) -> None:
        assert max_tokens_for(100, 29, max_prompt_tokens=None, context=128) == 28
        assert max_tokens_for(127, 10**9, max_prompt_tokens=None, context=128) == 1
        assert max_tokens_for(100, 10**9, max_prompt_tokens=None, context=None) == (
            10**9
        )
        # Echo with max_tokens 0 scores a prompt that fills the context.
        assert max_tokens_for(128, 0, max_prompt_tokens=None, context=128) == 0

    def test_a_prompt_that_fills_the_context_is_refused(self) -> None:
        with pytest.raises(PromptTooLongError) as full:
            max_tokens_for(128, 1, max_prompt_tokens=None, context=128)
        assert "maximum context length is 128 tokens" in full.value.message
        assert "128 tokens, which leaves no room" in full.value.message
        assert (full.value.prompt_tokens, full.value.limit) == (128, 128)

    def test_text_bound(self) -> None:
        check_text_length(1000, 10, 100)
        with pytest.raises(PromptTooLongError) as info:
            check_text_length(1010, 10, 100)
        assert "101" in info.value.message

    def test_longest_token(self) -> None:
        vocab = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "Ġhello": 1})
        assert longest_token_chars(vocab) == 6
        assert longest_token_chars(object()) > 10**9


@pytest.mark.anyio
class TestServer:
    async def test_prompt_over_the_limit(self, serve: Serve) -> None:
        async with serve() as served:
            ok = await served.chat(vision_body(2))
            prompt = ok.json()["usage"]["prompt_tokens"]
        async with serve(max_prompt_tokens=prompt - 1) as served:
            before = served.thread.statistics()
            for stream in (False, True):
                response = await served.chat(vision_body(2, stream=stream))
                error = assert_error(
                    response, 400, "messages", "context_length_exceeded"
                )
                assert f"{prompt} tokens" in error["message"]
                assert str(prompt - 1) in error["message"]
            after = served.thread.statistics()
            assert after.open_streams == 0
            assert after.busy_time > before.busy_time  # counted on the MLX thread
            assert served.engine.statistics().prefills == 0  # refused before prefill
        async with serve(max_prompt_tokens=prompt) as served:
            assert (await served.chat(vision_body(2))).status_code == 200

    async def test_an_answer_stops_where_the_context_is_full(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Any API's request may ask for more tokens than the context leaves
        (no limit is set): its answer stops there, as the API says a length
        cut ends."""
        async with serve() as served:
            prompt = (await served.chat(vision_body(2))).json()["usage"][
                "prompt_tokens"
            ]
        context = prompt + 10
        # Read once per load (with the model's other capabilities).
        monkeypatch.setattr(
            LoadedModel, "context_length", property(lambda self: context)
        )
        text = [{"role": "user", "content": "Hi"}]
        async with serve() as served:
            chat = (await served.chat(vision_body(100_000))).json()
            assert chat["choices"][0]["finish_reason"] == "length"
            assert chat["usage"]["completion_tokens"] == 10
            unset = vision_body()
            del unset["max_tokens"]  # the default, 512
            chat = (await served.chat(unset)).json()
            assert chat["choices"][0]["finish_reason"] == "length"
            assert chat["usage"]["completion_tokens"] == 10
            post = served.client.post
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 100_000}
            completion = (await post("/v1/completions", json=body)).json()
            assert completion["choices"][0]["finish_reason"] == "length"
            assert completion["usage"]["total_tokens"] == context
            body = {"model": MODEL, "messages": text, "max_tokens": 100_000}
            message = (await post("/v1/messages", json=body)).json()
            assert message["stop_reason"] == "max_tokens"
            usage = message["usage"]
            assert usage["input_tokens"] + usage["output_tokens"] == context
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 100_000}
            response = (await post("/v1/responses", json=body)).json()
            assert response["status"] == "incomplete"
            assert response["incomplete_details"] == {"reason": "max_output_tokens"}
            assert response["usage"]["total_tokens"] == context
            options = {"num_predict": -1}
            body = {"model": MODEL, "messages": text, "options": options}
            body["stream"] = False
            ollama = (await post("/api/chat", json=body)).json()
            assert ollama["done_reason"] == "length"
            assert ollama["prompt_eval_count"] + ollama["eval_count"] == context

    async def test_an_operators_limit_is_a_400_on_every_api(self, serve: Serve) -> None:
        text = [{"role": "user", "content": "Hi"}]
        async with serve(max_tokens_limit=20) as served:
            post = served.client.post
            assert_error(await served.chat(vision_body(21)), 400, "max_tokens")
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 21}
            answer = await post("/v1/completions", json=body)
            assert_error(answer, 400, "max_tokens", "invalid_value")
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 21}
            answer = await post("/v1/responses", json=body)
            assert_error(answer, 400, "max_output_tokens", "invalid_value")
            body = {"model": MODEL, "messages": text, "max_tokens": 21}
            answer = await post("/v1/messages", json=body)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "limit of 20 tokens" in error["message"]
            body = {"model": MODEL, "messages": text, "stream": False}
            answer = await post(
                "/api/chat", json=body | {"options": {"num_predict": 21}}
            )
            assert answer.status_code == 400
            assert "options.num_predict" in answer.json()["error"]
            # -1 (no limit) is the operator's limit.
            options = {"num_predict": -1, "temperature": 0}
            answer = await post("/api/chat", json=body | {"options": options})
            assert (answer.json()["done_reason"], answer.json()["eval_count"]) == (
                "length",
                20,
            )

    async def test_a_prompt_that_fills_the_context_is_refused(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with serve() as served:
            prompt = (await served.chat(vision_body(2))).json()["usage"][
                "prompt_tokens"
            ]
        monkeypatch.setattr(LoadedModel, "context_length", property(lambda _: prompt))
        async with serve() as served:
            error = assert_error(await served.chat(vision_body(1)), 400, "messages")
            assert f"maximum context length is {prompt} tokens" in error["message"]
            assert "leaves no room for an answer" in error["message"]
            assert served.engine.statistics().prefills == 0  # refused before prefill

    async def test_huge_text_is_refused_before_the_model(self, serve: Serve) -> None:
        async with serve(max_prompt_tokens=100) as served:
            longest = served.model.longest_token_chars
            before = served.thread.statistics()
            body: dict[str, Any] = vision_body(2, prompt="x" * (101 * longest + 1))
            error = assert_error(await served.chat(body), 400, "messages")
            assert "at least 101 tokens" in error["message"]
            after = served.thread.statistics()
            # Never reached the MLX thread: nothing ran there.
            assert (after.completed, after.failed) == (before.completed, before.failed)
