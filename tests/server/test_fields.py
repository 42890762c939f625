"""Every chat-completions field of OpenAI's reference is honoured or refused
by name; unknown fields are refused as OpenAI refuses them."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from mlx_pinned.server.events import Grammar
from mlx_pinned.server.http.chat_completions.messages import chat_messages
from mlx_pinned.server.http.chat_completions.protocol import (
    ChatCompletionRequest,
    parse_chat_request,
)
from mlx_pinned.server.http.errors import APIError

from .conftest import vision_body
from .kit import Serve
from .kit import chat_bytes as body

# OpenAI's chat-completions request fields (API reference, 2025).
OPENAI_FIELDS = {
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "messages", "metadata",
    "modalities", "model", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
}  # fmt: skip
VLLM_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "chat_template_kwargs"}
VLLM_EXTENSIONS |= {"thinking_token_budget"}
# vLLM's stopping, vocabulary and text fields (protocol_common.py).
VLLM_EXTENSIONS |= {
    "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids",
}  # fmt: skip
# vLLM's assistant prefill.
VLLM_EXTENSIONS |= {"add_generation_prompt", "continue_final_message"}
VLLM_EXTENSIONS |= {"add_special_tokens"}
# vLLM's token naming, prompt cutting and banned words (protocol_common.py).
VLLM_EXTENSIONS |= {"return_tokens_as_token_ids", "truncate_prompt_tokens"}
VLLM_EXTENSIONS |= {"bad_words"}
# vLLM's admission order (http/served_models.py).
VLLM_EXTENSIONS |= {"priority"}
# vLLM's prompt log-probabilities (prefill.py, vllm_extensions.py).
VLLM_EXTENSIONS |= {"prompt_logprobs"}
# vLLM's constrained answers (vllm_extensions.py).
VLLM_EXTENSIONS |= {
    "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
}  # fmt: skip
# vllm-mlx's video sampling.
VLLM_EXTENSIONS |= {"video_fps", "video_max_frames"}
# llama.cpp's prefill progress on streams (http/chat_completions/bodies.py).
VLLM_EXTENSIONS |= {"return_progress"}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

SCHEMA_WITHOUT = {"type": "json_schema"}
BAD_NAME = {"type": "json_schema", "json_schema": {"name": "a b"}}
NAMED_G = {"type": "function", "function": {"name": "g"}}
JSON = {"type": "json_object"}
# Fields OpenAI documents that change nothing a local model generates.
WITHOUT_EFFECT: dict[str, Any] = {
    "user": "u",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "metadata": {"a": "b"},
    "store": False,
    "service_tier": "auto",
    "modalities": ["text"],
    "verbosity": "medium",
    "audio": None,
    "functions": None,
}


def refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(body(**fields))
    assert info.value.status == 400
    return info.value


def params(**fields: Any) -> Any:
    return parse_chat_request(body(**fields)).to_generation_params(16)


class TestEveryField:
    def test_every_openai_field_and_extension_is_declared(self) -> None:
        declared = {
            field.alias or name
            for name, field in ChatCompletionRequest.model_fields.items()
        }
        assert declared == OPENAI_FIELDS | VLLM_EXTENSIONS

    def test_every_field_the_installed_sdk_sends_is_declared(self) -> None:
        # A tripwire for fields OpenAI adds: the SDK gains them first.
        from openai.types.chat import completion_create_params

        sdk = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
        declared = set(ChatCompletionRequest.model_fields)
        assert sdk - declared == set()

    @pytest.mark.parametrize("name", ["foo", "best_of", "use_beam_search"])
    def test_an_unknown_field_is_refused_by_name(self, name: str) -> None:
        error = refused(**{name: 1})
        assert error.param == name
        assert error.code == "unknown_parameter"
        assert error.message == f"Unrecognized request argument supplied: {name}."

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("audio", {"voice": "alloy", "format": "wav"}),
            ("functions", [{"name": "f"}]),
            ("function_call", "auto"),
            ("moderation", {"model": "omni-moderation-latest"}),
            ("web_search_options", {}),
        ],
    )
    def test_fields_this_server_cannot_honour_are_refused(
        self, name: str, value: Any
    ) -> None:
        error = refused(**{name: value})
        assert error.param == name
        assert error.code == "unsupported_parameter"
        assert f"'{name}'" in error.message

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("store", True),
            ("service_tier", "flex"),
            ("service_tier", "priority"),
            ("service_tier", "fast"),
            ("modalities", ["text", "audio"]),
            ("verbosity", "low"),
        ],
    )
    def test_values_this_server_cannot_honour_are_refused(
        self, name: str, value: Any
    ) -> None:
        error = refused(**{name: value})
        assert (error.param, error.code) == (name, "unsupported_value")

    def test_fields_without_effect_on_the_output_are_accepted(self) -> None:
        plain = parse_chat_request(body())
        given = parse_chat_request(body(**WITHOUT_EFFECT))
        # Accepted, and nothing of them reaches the engine or the template.
        assert given.to_generation_params(16) == plain.to_generation_params(16)
        assert chat_messages(given.messages) == chat_messages(plain.messages)

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"metadata": {"a": 1}}, "metadata.a"),
            ({"user": 5}, "user"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": -2.01}, "frequency_penalty"),
            ({"top_k": -2}, "top_k"),
            ({"min_p": 1.5}, "min_p"),
            ({"repetition_penalty": 0}, "repetition_penalty"),
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": []}, "chat_template_kwargs"),
            ({"response_format": {"type": "xml"}}, "response_format"),
            ({"response_format": SCHEMA_WITHOUT}, "response_format.json_schema"),
            ({"response_format": BAD_NAME}, "response_format.json_schema.name"),
            ({"tools": []}, "tools"),
            ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
            ({"tools": [TOOL, TOOL]}, "tools"),
            ({"tool_choice": "auto"}, "tool_choice"),
            ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
            ({"tools": [TOOL], "tool_choice": NAMED_G}, "tool_choice"),
            (
                {"tools": [TOOL], "tool_choice": "required", "response_format": JSON},
                "response_format",
            ),
            ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ],
    )  # fmt: skip
    def test_invalid_values_name_their_param(
        self, fields: dict[str, Any], param: str
    ) -> None:
        assert refused(**fields).param == param


@pytest.mark.anyio
class TestWithoutEffect:
    async def test_the_answer_is_the_same_with_them_and_without(
        self, serve: Serve
    ) -> None:
        request = vision_body(8, logprobs=True, top_logprobs=2)
        async with serve() as served:
            plain = await served.chat(request)
            given = await served.chat({**request, **WITHOUT_EFFECT})
        assert (plain.status_code, given.status_code) == (200, 200)
        first, second = plain.json()["choices"][0], given.json()["choices"][0]
        assert second["message"] == first["message"]
        assert second["logprobs"] == first["logprobs"]
        assert second["finish_reason"] == first["finish_reason"]
        counts = ("prompt_tokens", "completion_tokens")
        used, used_plain = given.json()["usage"], plain.json()["usage"]
        assert [used[key] for key in counts] == [used_plain[key] for key in counts]


class TestParams:
    def test_samplers_and_penalties_reach_the_engine(self) -> None:
        got = params(
            presence_penalty=0.5,
            frequency_penalty=-1,
            repetition_penalty=1.2,
            top_k=5,
            min_p=0.1,
        ).sampling
        assert (got.presence_penalty, got.frequency_penalty) == (0.5, -1.0)
        assert (got.repetition_penalty, got.top_k, got.min_p) == (1.2, 5, 0.1)

    def test_defaults_are_off(self) -> None:
        got = params()
        sampling = got.sampling
        assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.0, 0.0)
        assert (sampling.repetition_penalty, sampling.min_p) == (1.0, 0.0)
        assert sampling.top_k is None
        assert (got.grammar, got.tools, got.template_kwargs) == (None, (), ())

    def test_top_k_minus_one_is_no_limit(self) -> None:
        assert params(top_k=-1).sampling.top_k == 0

    def test_template_kwargs_reach_the_template(self) -> None:
        got = params(chat_template_kwargs={"enable_thinking": False})
        assert got.template_kwargs == (("enable_thinking", False),)

    def test_tools_go_to_the_template_unless_none(self) -> None:
        assert params(tools=[TOOL]).tools == (TOOL,)
        assert params(tools=[TOOL], tool_choice="auto").tools == (TOOL,)
        assert params(tools=[TOOL], tool_choice="none").tools == ()

    def test_a_grammar_is_passed_through(self) -> None:
        request = parse_chat_request(body())
        grammar = Grammar("json_object")
        assert request.to_generation_params(4, grammar=grammar).grammar == grammar


class TestPrediction:
    def test_text_or_text_parts(self) -> None:
        assert (
            params(prediction={"type": "content", "content": "a b"}).prediction == "a b"
        )
        parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
        got = params(prediction={"type": "content", "content": parts})
        assert got.prediction == "a b"
        assert params().prediction == ""

    def test_another_type_is_refused(self) -> None:
        error = refused(prediction={"type": "audio", "content": "x"})
        assert error.param == "prediction.type"

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_the_answer_is_the_same_and_its_tokens_counted(
        self, serve: Serve
    ) -> None:
        async with serve() as served:
            sdk = served.sdk()
            asked: dict[str, Any] = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Say it twice."}],
                "max_tokens": 32,
                "temperature": 0,
            }
            plain = await sdk.chat.completions.create(**asked)
            text = plain.choices[0].message.content
            assert text
            assert plain.usage is not None
            assert plain.usage.completion_tokens_details is None  # none sent
            guess = {"type": "content", "content": text}
            again = await sdk.chat.completions.create(**asked, prediction=guess)
            assert again.choices[0].message.content == text
            usage = again.usage
            assert usage is not None
            assert usage.completion_tokens_details is not None
            assert usage.completion_tokens_details.accepted_prediction_tokens > 5
            # Beside a grammar, refused by name.
            with pytest.raises(openai.BadRequestError) as caught:
                await sdk.chat.completions.create(
                    **asked, prediction=guess, response_format={"type": "json_object"}
                )
            error = caught.value.body
            assert error["param"] == "prediction"  # type: ignore[index]
            assert "response_format" in error["message"]  # type: ignore[index]

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_beside_bad_words_it_is_used(self, serve: Serve) -> None:
        asked: dict[str, Any] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say it twice."}],
            "max_tokens": 32,
            "temperature": 0,
        }
        async with serve() as served:
            free = (await served.chat(asked)).json()["choices"][0]["message"]
            words = free["content"].split()
            barred = {**asked, "bad_words": [words[len(words) // 2]]}
            plain = (await served.chat(barred)).json()
            guess = {"type": "content", "content": free["content"]}
            again = (await served.chat({**barred, "prediction": guess})).json()
        text = plain["choices"][0]["message"]["content"]
        assert again["choices"][0]["message"]["content"] == text
        details = again["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_beside_a_penalty_it_is_refused_naming_both(
        self, serve: Serve
    ) -> None:
        guess = {"type": "content", "content": "a b"}
        penalties = {
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
        }
        async with serve() as served:
            for name, value in penalties.items():
                body = {**vision_body(prediction=guess), name: value}
                response = await served.chat(body)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "prediction"
                assert "'prediction'" in error["message"]
                assert name in error["message"]


class TestToolMessages:
    def test_tool_turns_reach_the_template_as_hermes_templates_read_them(
        self,
    ) -> None:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        request = parse_chat_request(
            body(
                tools=[TOOL],
                messages=[
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                    {
                        "role": "tool",
                        "tool_call_id": "call_2",
                        "content": [{"type": "text", "text": "Warm"}],
                    },
                ],
            )
        )
        assert chat_messages(request.messages)[1:] == [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris"},
                        },
                    }
                ],
            },
            {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
            {"role": "tool", "content": "Warm", "tool_call_id": "call_2"},
        ]

    def test_arguments_that_are_no_object_stay_text(self) -> None:
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "f", "arguments": "not json"},
        }
        request = parse_chat_request(
            body(messages=[{"role": "assistant", "tool_calls": [call]}])
        )
        turn = chat_messages(request.messages)[0]
        assert turn["tool_calls"][0]["function"]["arguments"] == "not json"

    def test_a_tool_message_needs_its_call_id(self) -> None:
        error = refused(messages=[{"role": "tool", "content": "x"}])
        assert error.param == "messages[0].tool_call_id"
