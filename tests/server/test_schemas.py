from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_pinned.server.http.chat_completions.bodies import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    ChunkEncoder,
    Delta,
    ResponseMessage,
    Usage,
    completion_id,
)
from mlx_pinned.server.http.chat_completions.messages import ImagePart, UserMessage
from mlx_pinned.server.http.chat_completions.protocol import (
    ChatCompletionRequest,
    parse_chat_request,
)
from mlx_pinned.server.http.errors import OPENAI_ERRORS, APIError

from .kit import chat_bytes as body


def user(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TEXT = {"type": "text", "text": "Describe this image in one sentence."}


class TestValidRequests:
    def test_bug_report_shape(self) -> None:
        request = parse_chat_request(body(messages=user(TEXT, IMG), max_tokens=80))
        message = request.messages[0]
        assert isinstance(message, UserMessage)
        assert isinstance(message.content, list)
        assert isinstance(message.content[1], ImagePart)
        assert message.content[1].image_url.url == "data:image/png;base64,AAAA"
        assert request.requested_max_tokens == 80

    def test_image_url_as_string(self) -> None:
        part = {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}
        request = parse_chat_request(body(messages=user(part)))
        message = request.messages[0]
        assert isinstance(message.content, list)
        image = message.content[0]
        assert isinstance(image, ImagePart)
        assert image.image_url.url == "data:image/png;base64,AAAA"

    def test_multi_turn_and_roles(self) -> None:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "x"}]},
            {"role": "user", "content": [TEXT, IMG]},
            {"role": "assistant", "content": "A cat."},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "And the colour?"},
        ]
        request = parse_chat_request(body(messages=messages))
        assert [m.role for m in request.messages] == [
            "system",
            "developer",
            "user",
            "assistant",
            "assistant",
            "user",
        ]

    def test_unknown_keys_inside_messages_are_ignored(self) -> None:
        # A message replayed from a response carries keys a request has not.
        message = {"role": "assistant", "content": "x", "refusal": None, "audio": None}
        request = parse_chat_request(body(messages=[message]))
        assert request.messages[0].content == "x"

    def test_max_completion_tokens_wins(self) -> None:
        request = parse_chat_request(body(max_tokens=5, max_completion_tokens=7))
        assert request.requested_max_tokens == 7
        assert parse_chat_request(body()).requested_max_tokens is None

    def test_stop_forms(self) -> None:
        assert parse_chat_request(body(stop="x")).stop_sequences == ("x",)
        assert parse_chat_request(body(stop=["a", "b"])).stop_sequences == ("a", "b")
        assert parse_chat_request(body()).stop_sequences == ()

    def test_sampling_bounds_accepted(self) -> None:
        request = parse_chat_request(
            body(temperature=0, top_p=1, seed=-3, logprobs=True, top_logprobs=20, n=1)
        )
        assert request.temperature == 0.0
        assert request.top_p == 1.0
        assert request.top_logprobs == 20

    def test_include_usage(self) -> None:
        request = parse_chat_request(
            body(stream=True, stream_options={"include_usage": True})
        )
        assert request.include_usage
        assert not parse_chat_request(body(stream=True)).include_usage


INVALID = [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_type"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model",
     "missing_required_parameter"),
    (body(messages=[]), "messages", "empty_array"),
    (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id",
     "missing_required_parameter"),
    (body(messages=[{"role": "function", "content": "x"}]), "messages[0]",
     "invalid_type"),
    (body(messages=[{"role": "user"}]), "messages[0].content",
     "missing_required_parameter"),
    (body(messages=[{"role": "user", "content": 5}]), "messages[0].content",
     "invalid_type"),
    (body(messages=user(TEXT, {"type": "image_url", "image_url": 5})),
     "messages[0].content[1].image_url", "invalid_type"),
    (body(messages=user(TEXT, {"type": "image_url"})),
     "messages[0].content[1].image_url", "missing_required_parameter"),
    (body(messages=user({"type": "text"})), "messages[0].content[0].text",
     "missing_required_parameter"),
    (body(messages=user({"type": "video"})), "messages[0].content[0]", "invalid_type"),
    (body(messages=[{"role": "system", "content": [IMG]}]),
     "messages[0].content[0].type", "invalid_type"),
    (body(max_tokens=0), "max_tokens", "invalid_value"),
    (body(max_tokens="10"), "max_tokens", "invalid_type"),
    (body(max_completion_tokens=1.5), "max_completion_tokens", "invalid_type"),
    (body(temperature=2.5), "temperature", "invalid_value"),
    (body(temperature=-0.1), "temperature", "invalid_value"),
    (body(top_p=0), "top_p", "invalid_value"),
    (body(top_p=1.01), "top_p", "invalid_value"),
    (body(seed=2**64), "seed", "invalid_value"),
    (body(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
    (body(stop=""), "stop", "invalid_value"),
    (body(stop=[1]), "stop[0]", "invalid_type"),
    (body(logprobs="yes"), "logprobs", "invalid_type"),
    (body(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (body(top_logprobs=2), "top_logprobs", "invalid_value"),
    (body(messages=[{"role": "user", "content": []}]), "messages[0].content",
     "empty_array"),
    (body(messages=[{"role": "system", "content": []}]), "messages[0].content",
     "empty_array"),
    # int() of a key past Python's 4300 digits raised in the handler: a 500.
    (body(logit_bias={"1" * 4301: 1}), "logit_bias", "invalid_value"),
    (body(logit_bias={"12345678901": 1}), "logit_bias", "invalid_value"),
    (body(logit_bias={"5": 1, "05": -1}), "logit_bias", "invalid_value"),
    (body(logit_bias={"0" * 5000 + "5": 1, "5": 1}), "logit_bias", "invalid_value"),
    (body(n=2), "n", "invalid_value"),
    (body(stream=1), "stream", "invalid_type"),
    (body(stream_options={"include_usage": "yes"}), "stream_options.include_usage",
     "invalid_type"),
]  # fmt: skip


def bias(request: ChatCompletionRequest) -> tuple[tuple[int, float], ...]:
    """The request's ``logit_bias`` as the sampler gets it."""
    return request.to_generation_params(16).sampling.logit_bias


class TestInvalidRequests:
    @pytest.mark.parametrize(
        ("raw", "param", "code"), INVALID, ids=[f"{p}-{c}" for _, p, c in INVALID]
    )
    def test_is_400_naming_the_param(
        self, raw: bytes, param: str | None, code: str
    ) -> None:
        with pytest.raises(APIError) as info:
            parse_chat_request(raw)
        error = info.value
        assert error.status == 400
        assert error.param == param
        assert error.code == code
        assert json.loads(OPENAI_ERRORS.body(error))["error"]["type"] == (
            "invalid_request_error"
        )
        if param is not None:
            assert f"'{param}'" in error.message
        assert error.message.endswith(".")

    def test_union_message_lists_both_forms(self) -> None:
        with pytest.raises(APIError) as info:
            parse_chat_request(body(messages=[{"role": "user", "content": 5}]))
        assert "valid string, or input should be a valid array" in info.value.message

    @pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity"])
    def test_non_finite_numbers_are_named_so(self, raw: bytes) -> None:
        for field in (b"temperature", b"top_p"):
            text = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "'
            with pytest.raises(APIError) as info:
                parse_chat_request(text + field + b'": ' + raw + b"}")
            assert info.value.param == field.decode()
            assert "finite number" in info.value.message  # not "less than 2"

    def test_logit_bias_keys_may_have_leading_zeros(self) -> None:
        request = parse_chat_request(body(logit_bias={"0005": 2, "7": -1}))
        assert bias(request) == ((5, 2), (7, -1))
        # Past Python's 4300-digit int() limit, zeros only: still token 5.
        request = parse_chat_request(body(logit_bias={"0" * 5000 + "5": 1}))
        assert bias(request) == ((5, 1),)

    def test_custom_messages_have_no_pydantic_prefix(self) -> None:
        with pytest.raises(APIError) as info:
            parse_chat_request(body(n=3))
        assert "Value error" not in info.value.message
        assert "only n=1 is supported" in info.value.message


class TestErrors:
    def test_openai_shape(self) -> None:
        error = APIError(400, "m", param="p", code="c")
        assert json.loads(OPENAI_ERRORS.body(error)) == {
            "error": {
                "message": "m",
                "type": "invalid_request_error",
                "param": "p",
                "code": "c",
            }
        }

    @pytest.mark.parametrize(
        ("status", "kind"),
        [
            (400, "invalid_request_error"),
            (404, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "server_error"),
            (503, "server_error"),
        ],
    )
    def test_type_from_status(self, status: int, kind: str) -> None:
        error = APIError(status, "x", headers={"Retry-After": "1"})
        assert json.loads(OPENAI_ERRORS.body(error))["error"]["type"] == kind
        assert error.headers == {"Retry-After": "1"}


class TestResponses:
    def test_completion_id(self) -> None:
        first, created = completion_id()
        second, _ = completion_id()
        assert first.startswith("chatcmpl-")
        assert first != second
        assert created > 1_700_000_000

    @pytest.mark.slow
    def test_completion_ids_differ_across_a_fork(self) -> None:
        # In a fresh process with no threads, so the fork is safe.
        script = """if True:
            import os
            from mlx_pinned.server.http.chat_completions.bodies import completion_id
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                os.write(write, completion_id()[0].encode())
                os._exit(0)
            os.waitpid(child, 0)
            theirs = os.read(read, 100).decode()
            ours = completion_id()[0]
            assert theirs.startswith("chatcmpl-") and theirs != ours, (theirs, ours)
        """
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)

    def test_completion_shape(self) -> None:
        completion = ChatCompletion(
            id="chatcmpl-1",
            created=1,
            model="m",
            choices=[
                Choice(message=ResponseMessage(content="hi"), finish_reason="stop")
            ],
            usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4),
        )
        data = json.loads(completion.model_dump_json())
        assert data["object"] == "chat.completion"
        assert data["choices"][0] == {
            "index": 0,
            "message": {"role": "assistant", "content": "hi", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,  # vLLM's
        }
        assert data["usage"]["total_tokens"] == 4

    def test_chunk_usage_field(self) -> None:
        chunk = ChatCompletionChunk(
            id="chatcmpl-1",
            created=1,
            model="m",
            choices=[ChunkChoice(delta=Delta(content="x"))],
        )
        with_usage = chunk.to_sse(include_usage=True)
        without = chunk.to_sse(include_usage=False)
        assert with_usage.startswith(b"data: ")
        assert with_usage.endswith(b"\n\n")
        assert json.loads(with_usage[6:])["usage"] is None
        assert "usage" not in json.loads(without[6:])
        assert json.loads(without[6:])["object"] == "chat.completion.chunk"


class TestChunkEncoder:
    @given(
        text=st.text(),
        include_usage=st.booleans(),
        model=st.text(min_size=1, max_size=40),
    )
    def test_content_chunks_equal_the_pydantic_ones(
        self, text: str, include_usage: bool, model: str
    ) -> None:
        chunk_id, created = completion_id()
        encoder = ChunkEncoder(chunk_id, created, model, include_usage=include_usage)
        full = ChatCompletionChunk(
            id=chunk_id,
            created=created,
            model=model,
            choices=[ChunkChoice(delta=Delta(content=text))],
        ).to_sse(include_usage=include_usage)
        assert encoder.content(text) == full
        assert json.loads(full[len(b"data: ") :])["choices"][0]["delta"] == {
            "content": text
        }

    def test_other_chunks_go_through_the_models(self) -> None:
        encoder = ChunkEncoder("chatcmpl-1", 7, "m", include_usage=True)
        usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
        last = json.loads(encoder.chunk([], usage)[len(b"data: ") :])
        assert last["choices"] == []
        assert last["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
