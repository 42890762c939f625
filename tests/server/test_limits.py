"""Prompt-length limits: a 400 that gives the numbers, before any prefill."""

from __future__ import annotations

import types
from typing import Any

import pytest

from mlx_pinned.server.engine import LoadedModel
from mlx_pinned.server.failures import PromptTooLongError
from mlx_pinned.server.http.errors import api_error
from mlx_pinned.server.limits import (
    check_prompt_tokens,
    check_text_length,
    context_length,
    longest_token_chars,
)

from .conftest import assert_error, vision_body
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
        check_prompt_tokens(100, 28, max_prompt_tokens=100, context=128)
        with pytest.raises(PromptTooLongError) as over:
            check_prompt_tokens(101, 1, max_prompt_tokens=100, context=None)
        assert "101" in over.value.message
        assert "100" in over.value.message
        assert (over.value.prompt_tokens, over.value.limit) == (101, 100)
        answer = api_error(over.value, retry_after=1)
        assert answer is not None
        assert (answer.status, answer.param) == (400, "messages")
        assert answer.code == "context_length_exceeded"
        with pytest.raises(PromptTooLongError) as context:
            check_prompt_tokens(100, 29, max_prompt_tokens=None, context=128)
        for number in ("128", "100", "29", "129"):
            assert number in context.value.message

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

    async def test_prompt_and_max_tokens_over_the_context(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with serve() as served:
            prompt = (await served.chat(vision_body(2))).json()["usage"][
                "prompt_tokens"
            ]
        context = prompt + 10
        # Read once per load (with the model's other capabilities).
        monkeypatch.setattr(
            LoadedModel, "context_length", property(lambda self: context)
        )
        async with serve() as served:
            error = assert_error(await served.chat(vision_body(11)), 400, "messages")
            assert f"maximum context length is {context} tokens" in error["message"]
            assert f"{prompt} prompt tokens" in error["message"]
            assert "11 completion tokens" in error["message"]
            assert (await served.chat(vision_body(10))).status_code == 200

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
