"""The output formats' registry: a model's formats are detected from its
chat template or named by a setting, and forced calls in a format come out
exactly as asked, on the tiny random-weight model through the HTTP app."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from mlx_pinned.server import create_app
from mlx_pinned.server.config import ServerConfig
from mlx_pinned.server.engine.model import LoadedModel
from mlx_pinned.server.events import Grammar
from mlx_pinned.server.formats import (
    REASONING_FORMATS,
    TOOL_CALL_FORMATS,
    ToolSpec,
    model_formats,
    reasoning_format,
    tool_call_format,
)
from mlx_pinned.server.grammars import GrammarCache
from mlx_pinned.testing import _CHAT_TEMPLATE

from .conftest import MODEL, assert_error, sse_events
from .kit import CLOCK, WEATHER, Serve, Served, assert_no_markup, join_chat_chunks

pytestmark = pytest.mark.anyio


QWEN3_HYBRID = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
QWEN3_THINKING = (
    "{%- if '</think>' in content %}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}"
)
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"

NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class TestRegistry:
    def test_formats_are_detected_from_the_chat_template(self) -> None:
        formats = model_formats(_CHAT_TEMPLATE)  # the tiny model's, Qwen3's shape
        assert formats.tool_call is TOOL_CALL_FORMATS["hermes"]
        assert formats.reasoning is REASONING_FORMATS["think"]
        assert model_formats(QWEN3_HYBRID).tool_call is None
        plain = model_formats(PLAIN)
        assert (plain.tool_call, plain.reasoning) == (None, None)
        # No template at all: the Qwen-VL family's tool format, no reasoning.
        assert model_formats(None).tool_call is TOOL_CALL_FORMATS["hermes"]
        assert model_formats(None).reasoning is None

    def test_whether_the_answer_starts_in_the_reasoning(self) -> None:
        think = REASONING_FORMATS["think"]
        assert not think.opens(QWEN3_HYBRID, {})
        assert think.opens(QWEN3_THINKING, {})
        guarded = (
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is true %}{{- '<think>\\n' }}{%- endif %}"
            "{%- endif %}"
        )
        assert not think.opens(guarded, {})
        assert not think.opens(guarded, {"enable_thinking": False})
        assert think.opens(guarded, {"enable_thinking": True})

    def test_a_setting_overrides_the_detection(self) -> None:
        named = model_formats(
            PLAIN, tool_call_parser="hermes", reasoning_parser="think"
        )
        assert named.tool_call is TOOL_CALL_FORMATS["hermes"]
        assert named.reasoning is REASONING_FORMATS["think"]
        off = model_formats(
            _CHAT_TEMPLATE, tool_call_parser="none", reasoning_parser="none"
        )
        assert (off.tool_call, off.reasoning) == (None, None)

    @pytest.mark.parametrize("kind", ["tool_call_parser", "reasoning_parser"])
    def test_an_unknown_name_is_refused_with_the_known_ones(self, kind: str) -> None:
        names = TOOL_CALL_FORMATS if kind == "tool_call_parser" else REASONING_FORMATS
        known = ", ".join([*names, "none"])
        setting: dict[str, Any] = {kind: "xml"}
        with pytest.raises(ValueError, match=f"{kind} 'xml'.*{known}"):
            model_formats(PLAIN, **setting)
        with pytest.raises(ValueError, match=known):
            ServerConfig(model="m", **setting)
        with pytest.raises(ValueError, match=r"model 'b'.*'xml'"):
            ServerConfig(
                model=("a", "b"),
                served_model_name=("a", "b"),
                model_settings=({}, setting),
            )

    def test_names_get_their_entries(self) -> None:
        for name, tools in TOOL_CALL_FORMATS.items():
            assert tool_call_format(name) is tools
            assert tools.name == name
        for name, reasoning in REASONING_FORMATS.items():
            assert reasoning_format(name) is reasoning
            assert reasoning.name == name
        assert tool_call_format("none") is None
        assert reasoning_format("none") is None

    @pytest.mark.parametrize("name", list(TOOL_CALL_FORMATS))
    @pytest.mark.parametrize("parallel", [True, False])
    def test_every_forced_call_grammar_compiles(
        self, name: str, parallel: bool
    ) -> None:
        tools = [
            ToolSpec("get_weather", WEATHER["function"]["parameters"]),  # type: ignore[index]
            ToolSpec("get_time"),
        ]
        source = TOOL_CALL_FORMATS[name].grammar(tools, parallel)
        assert GrammarCache().compile(Grammar("lark", source))  # it compiles
        assert "get_weather" in source
        assert "get_time" in source

    def test_a_parser_reads_what_its_grammar_forces(self) -> None:
        # The forced text of one call, written out as the grammar allows it.
        hermes = TOOL_CALL_FORMATS["hermes"]
        text = (
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
            "</tool_call>"
        )
        parser = hermes.parser()
        pieces = parser.feed(text) + parser.end()
        assert parser.calls == 1
        assert not [piece for piece in pieces if isinstance(piece, str)]


@pytest.fixture
async def sdk(serve: Serve) -> AsyncIterator[tuple[Served, openai.AsyncOpenAI]]:
    async with serve() as served:
        client = served.sdk()
        yield served, client


async def whole_and_streamed(
    served: Served, client: openai.AsyncOpenAI, **fields: Any
) -> list[dict[str, Any]]:
    """The answer to one request, non-streamed (through the SDK) and
    streamed (joined from its deltas), each as content, calls and finish."""
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, **fields}
    reply = await client.chat.completions.create(**body)
    choice = reply.choices[0]
    whole = {
        "content": choice.message.content or "",
        "calls": [
            (call.function.name, call.function.arguments)
            for call in choice.message.tool_calls or []
        ],
        "finish": choice.finish_reason,
    }
    response = await served.chat({**body, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]", events[-3:]
    joined = join_chat_chunks(
        ChatCompletionChunk.model_validate(e) for e in events[:-1]
    )
    stream = {
        "content": joined.content,
        "calls": joined.calls,
        "finish": joined.finish,
    }
    # Every answer of these tests: no format's markup in its content.
    assert_no_markup(whole["content"], stream["content"], context=fields)
    return [whole, stream]


@pytest.mark.slow
class TestForcedCalls:
    async def test_a_named_function_is_called_exactly_once(
        self, sdk: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        # parallel_tool_calls is left at its default (true): a named choice
        # still gives one call, and the answer ends there.
        served, client = sdk
        answers = await whole_and_streamed(
            served,
            client,
            max_tokens=200,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice=NAMED,
        )
        for answer in answers:
            assert answer["finish"] == "tool_calls", answer
            assert answer["content"] == ""
            [(name, arguments)] = answer["calls"]
            assert name == "get_weather"
            parameters = WEATHER["function"]["parameters"]  # type: ignore[index]
            jsonschema.validate(json.loads(arguments), parameters)
        assert answers[0] == answers[1]

    @pytest.mark.parametrize("max_tokens", [4, 20, 60])
    async def test_a_call_cut_by_max_tokens_leaves_no_markup_in_content(
        self, sdk: tuple[Served, openai.AsyncOpenAI], max_tokens: int
    ) -> None:
        # Cut in the opening tag, in the call's head, in its arguments.
        served, client = sdk
        answers = await whole_and_streamed(
            served,
            client,
            max_tokens=max_tokens,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
        )
        for answer in answers:
            assert answer["finish"] == "length", answer
            assert answer["content"] == "", answer
            for name, arguments in answer["calls"]:
                assert name in ("get_weather", "get_time")
                assert "tool_call" not in arguments
        assert answers[0] == answers[1]


class TestSettings:
    async def test_the_served_model_has_its_templates_formats(
        self, sdk: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        served, _ = sdk
        formats = served.engine.facts.formats
        assert formats.tool_call is not None
        assert formats.tool_call.name == "hermes"
        assert formats.reasoning is not None
        assert formats.reasoning.name == "think"

    async def test_tool_call_parser_none_refuses_tools(self, serve: Serve) -> None:
        async with serve(tool_call_parser="none") as served:
            body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER]}
            error = assert_error(
                await served.chat(body), 400, "tools", "unsupported_parameter"
            )
            assert "--tool-call-parser" in error["message"]
            plain = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
            assert (await served.chat(plain)).status_code == 200

    async def test_a_models_own_setting_applies_to_it(self, serve: Serve) -> None:
        own = ({"tool_call_parser": "none"},)
        async with serve(model_settings=own) as served:
            body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER]}
            assert_error(await served.chat(body), 400, "tools")

    async def test_a_named_format_serves_a_template_without_one(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The template the load reads its formats from.
        monkeypatch.setattr(LoadedModel, "chat_template", property(lambda self: PLAIN))
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 200,
            "temperature": 0,
            "tools": [WEATHER],
            "tool_choice": NAMED,
        }
        async with serve() as served:
            assert_error(await served.chat(body), 400, "tools")
        async with serve(tool_call_parser="hermes") as served:
            response = await served.chat(body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert len(choice["message"]["tool_calls"]) == 1

    async def test_reasoning_parser_none_keeps_the_reasoning_in_the_content(
        self, serve: Serve
    ) -> None:
        # The tiny template opens <think> when asked; random weights never
        # close it, so detected, the whole answer is reasoning.
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 8,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": True},
        }
        async with serve() as served:
            detected = (await served.chat(body)).json()["choices"][0]["message"]
        async with serve(reasoning_parser="none") as served:
            off = (await served.chat(body)).json()["choices"][0]["message"]
        assert detected["content"] == ""
        assert detected["reasoning_content"]
        assert "reasoning_content" not in off
        assert off["content"].strip() == detected["reasoning_content"].strip()

    def test_an_unknown_name_fails_the_start_up(self, tiny_model_path: Path) -> None:
        with pytest.raises(ValueError, match=r"'xml'.*hermes, none"):
            create_app(tiny_model_path, tool_call_parser="xml")
        with pytest.raises(ValueError, match=r"'xml'.*think, none"):
            create_app(tiny_model_path, reasoning_parser="xml")


class TestShownFormats:
    async def test_v1_models_shows_each_models_formats(self, serve: Serve) -> None:
        async with serve() as served:
            card = (await served.client.get(f"/v1/models/{MODEL}")).json()
            assert card["formats"] == {"tool_calls": "hermes", "reasoning": "think"}
        async with serve(tool_call_parser="mistral", reasoning_parser="none") as served:
            listing = (await served.client.get("/v1/models")).json()
            formats = listing["data"][0]["formats"]
            assert formats == {"tool_calls": "mistral", "reasoning": None}

    async def test_the_load_logs_the_formats_chosen(
        self, serve: Serve, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level("INFO", logger="mlx_pinned.server")
        async with serve(tool_call_parser="qwen3_coder"):
            pass
        [line] = [
            r.getMessage() for r in caplog.records if "tool calls in" in r.message
        ]
        assert MODEL in line
        assert "qwen3_coder (set)" in line
        assert "think (detected)" in line

    async def test_a_format_that_cannot_force_the_tools_is_a_400(
        self, serve: Serve
    ) -> None:
        tool = {
            "type": "function",
            "function": {
                "name": "plan",
                "parameters": {
                    "type": "object",
                    "properties": {"steps": {"type": "string", "pattern": "^a+$"}},
                    "required": ["steps"],
                },
            },
        }
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": [tool],
            "tool_choice": "required",
        }
        async with serve(tool_call_parser="pythonic") as served:
            error = assert_error(
                await served.chat(body), 400, "tool_choice", "unsupported_parameter"
            )
            assert "pythonic" in error["message"]
            assert "'steps'" in error["message"]
            body["tool_choice"] = "auto"
            body["max_tokens"] = 2
            assert (await served.chat(body)).status_code == 200


@pytest.mark.slow
class TestEveryFormatServed:
    @pytest.mark.parametrize("name", list(TOOL_CALL_FORMATS))
    async def test_a_forced_call_in_each_format_parses_back_valid(
        self, serve: Serve, name: str
    ) -> None:
        # The tiny model is served as if its template wrote this format: the
        # grammar forces a call in the format's syntax, its parser reads it.
        async with serve(tool_call_parser=name) as served:
            client = served.sdk()
            answers = await whole_and_streamed(
                served,
                client,
                max_tokens=200,
                temperature=0,
                tools=[WEATHER, CLOCK],
                tool_choice=NAMED,
            )
        for answer in answers:
            assert answer["finish"] == "tool_calls", answer
            assert answer["content"] == "", answer
            [(called, arguments)] = answer["calls"]
            assert called == "get_weather"
            parameters = WEATHER["function"]["parameters"]  # type: ignore[index]
            jsonschema.validate(json.loads(arguments), parameters)
        assert answers[0] == answers[1]

    @pytest.mark.parametrize("name", ["pythonic", "gemma4"])
    async def test_lists_and_objects_are_forced_in_the_formats_literals(
        self, serve: Serve, name: str
    ) -> None:
        parameters = {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["red", "blue"]},
                    "maxItems": 2,
                },
                "opts": {
                    "type": "object",
                    "properties": {"deep": {"type": "boolean"}, "n": {"type": "null"}},
                    "required": ["deep", "n"],
                },
            },
            "required": ["tags", "opts"],
        }
        tool = {
            "type": "function",
            "function": {"name": "plan", "parameters": parameters},
        }
        async with serve(tool_call_parser=name) as served:
            client = served.sdk()
            answers = await whole_and_streamed(
                served,
                client,
                max_tokens=200,
                temperature=0,
                tools=[tool],
                tool_choice="required",
            )
        for answer in answers:
            assert answer["finish"] == "tool_calls", answer
            assert answer["calls"], answer
            for called, arguments in answer["calls"]:
                assert called == "plan"
                jsonschema.validate(json.loads(arguments), parameters)
        assert answers[0] == answers[1]
