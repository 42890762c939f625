"""Tool calls, structured outputs and reasoning through the HTTP side, with
the official openai SDK, on a generation scripted on the MLX thread (the
engine's own constraint is tested with the engine)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionChunk

from mlx_pinned.server.events import (
    FinalEvent,
    GenerationParams,
    Grammar,
    TokenEvent,
    TokenLogprobs,
)
from mlx_pinned.server.formats import model_formats
from mlx_pinned.server.formats.blocks import MAX_FORCED_CALLS

from .conftest import MODEL, assert_error, replace_generation, sse_events
from .kit import Serve, Served

pytestmark = pytest.mark.anyio


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALLS = (
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
QWEN3_TEMPLATE = (
    "{%- if tools %}<tools>{%- for tool in tools %}{{ tool | tojson }}"
    "{%- endfor %}</tools> <tool_call>{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


class Script:
    """The engine's generation, scripted: ``pieces`` as tokens, each with a
    logprob entry when asked, then the end; records the params it got."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.finish: Any = "stop"
        self.params: list[GenerationParams] = []

    def __call__(
        self, loaded: Any, params: GenerationParams, images: Any
    ) -> Iterator[TokenEvent | FinalEvent]:
        self.params.append(params)
        for piece in self.pieces:
            logprobs = None
            if params.sampling.logprobs:
                logprobs = TokenLogprobs(piece, -0.5, list(piece.encode()), [])
            yield TokenEvent(piece, logprobs)
        yield FinalEvent("", self.finish, 3, len(self.pieces))


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Script:
    scripted = Script()
    replace_generation(monkeypatch, scripted)
    return scripted


@pytest.fixture
def template(
    client: tuple[Served, openai.AsyncOpenAI],
) -> Callable[[str], None]:
    """Set the chat template the HTTP side reads from the loaded engine's
    facts (its formats detected from it, as a load would)."""

    def set_template(text: str) -> None:
        engine = client[0].engine
        facts = engine.facts
        formats = model_formats(text)
        engine.facts = dataclasses.replace(facts, chat_template=text, formats=formats)

    return set_template


@pytest.fixture
async def client(serve: Serve) -> AsyncIterator[tuple[Served, openai.AsyncOpenAI]]:
    async with serve() as served:
        yield served, served.sdk()


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def both(
    client: tuple[Served, openai.AsyncOpenAI], **request: Any
) -> tuple[Any, list[ChatCompletionChunk]]:
    """The non-streamed answer (through the SDK) and the streamed chunks (as
    the SDK's types) of one request. The SDK's own stream leaves an async
    generator to the garbage collector, which trio reports as an error."""
    served, sdk = client
    request = {"model": MODEL, "max_tokens": 64, **request}
    whole = await sdk.chat.completions.create(**request)
    response = await served.chat({**request, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    return whole, [ChatCompletionChunk.model_validate(e) for e in events[:-1]]


def reassemble(chunks: list[Any]) -> dict[str, Any]:
    """A stream's deltas joined as an SDK user joins them."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.id is not None:
                    assert entry["name"] == "", "id and name come once, first"
                    entry["id"] = call.id
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def calls_of(message: Any) -> list[dict[str, Any]]:
    return [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


class TestToolCalls:
    async def test_calls_are_parsed_and_stream_as_openai_deltas(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        script.pieces = pieces(CALLS)
        messages = [{"role": "user", "content": "Weather and time in Paris?"}]
        whole, chunks = await both(client, messages=messages, tools=[WEATHER, TIME])
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        assert calls_of(choice.message) == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"name": "get_time", "arguments": "{}"},
        ]
        ids = [call.id for call in choice.message.tool_calls or []]
        assert all(i.startswith("call_") for i in ids)
        assert len(set(ids)) == 2
        streamed = reassemble(chunks)
        assert streamed["finish"] == "tool_calls"
        assert streamed["content"] == "Checking."
        assert [
            {k: c[k] for k in ("name", "arguments")} for c in streamed["calls"]
        ] == calls_of(choice.message)
        # The arguments came in fragments, and no markup leaked into content.
        fragments = [
            call
            for chunk in chunks
            for choice in chunk.choices
            for call in choice.delta.tool_calls or []
        ]
        assert len(fragments) > 4
        assert "tool_call" not in streamed["content"]
        # The engine was given the tools for the template, and no grammar.
        assert script.params[0].tools == (WEATHER, TIME)
        assert script.params[0].grammar is None

    async def test_an_answer_without_calls_is_plain_content(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        script.pieces = pieces("It is sunny <b>today</b>.\n")
        messages = [{"role": "user", "content": "Weather?"}]
        whole, chunks = await both(client, messages=messages, tools=[WEATHER])
        assert whole.choices[0].message.content == "It is sunny <b>today</b>.\n"
        assert whole.choices[0].message.tool_calls is None
        assert whole.choices[0].finish_reason == "stop"
        assert reassemble(chunks)["content"] == whole.choices[0].message.content

    async def test_tool_choice_none_tells_the_model_of_no_tools(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        _, sdk = client
        script.pieces = pieces(CALLS)
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="none",
        )
        assert script.params[0].tools == ()
        assert whole.choices[0].message.content == CALLS
        assert whole.choices[0].finish_reason == "stop"

    async def test_a_call_cut_by_max_tokens_finishes_with_length(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        script.pieces = pieces(CALLS[:60])
        script.finish = "length"
        whole, chunks = await both(
            client, messages=[{"role": "user", "content": "x"}], tools=[WEATHER]
        )
        assert whole.choices[0].finish_reason == "length"
        assert reassemble(chunks)["finish"] == "length"

    @pytest.mark.parametrize("parallel", [True, False])
    async def test_required_forces_a_call_by_grammar(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        parallel: bool,
    ) -> None:
        _, sdk = client
        script.pieces = pieces(CALLS.split("\n", 1)[1])
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        grammar = script.params[0].grammar
        assert grammar is not None
        assert grammar.kind == "lark"
        assert '\\"name\\": \\"get_weather\\"' in grammar.source
        assert '\\"name\\": \\"get_time\\"' in grammar.source
        more = f'("\\n" call){{0,{MAX_FORCED_CALLS - 1}}}'
        assert (more in grammar.source) is parallel
        assert len(whole.choices[0].message.tool_calls or []) == 2

    @pytest.mark.slow
    async def test_a_named_function_is_the_only_one_allowed(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        _, sdk = client
        script.pieces = ['<tool_call>\n{"name": "get_time", "arguments": {}}\n']
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        grammar = script.params[0].grammar
        assert grammar is not None
        assert "get_weather" not in grammar.source
        assert "get_time" in grammar.source
        # Exactly one call, then the end, whatever parallel_tool_calls says.
        assert "call)*" not in grammar.source
        assert calls_of(whole.choices[0].message) == [
            {"name": "get_time", "arguments": "{}"}
        ]

    async def test_a_tool_schema_llguidance_refuses_is_a_400_naming_it(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        served, _ = client
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER, bad],
            "tool_choice": "required",
        }
        response = await served.chat(body)
        assert_error(
            response, 400, "tools[1].function.parameters", "invalid_json_schema"
        )
        assert script.params == []

    async def test_a_second_turn_with_tool_results_is_served(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        _, sdk = client
        script.pieces = ["Sunny."]
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            tools=[WEATHER],  # type: ignore[list-item]
        )
        assert whole.choices[0].message.content == "Sunny."
        turns = script.params[0].messages
        assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
        assert turns[2] == {
            "role": "tool",
            "content": "sunny",
            "tool_call_id": "call_1",
        }

    async def test_a_template_without_a_tool_format_refuses_tools(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        template: Callable[[str], None],
    ) -> None:
        served, _ = client
        template("{% for m in messages %}{{ m.content }}{% endfor %}")
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER],
        }
        error = assert_error(
            await served.chat(body), 400, "tools", "unsupported_parameter"
        )
        assert "--tool-call-parser" in error["message"]
        assert "Hermes" not in error["message"]


class TestStructuredOutputs:
    async def test_json_schema_becomes_a_grammar_and_parse_works(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        _, sdk = client

        class City(pydantic.BaseModel):
            name: str
            people: int

        script.pieces = pieces('{"name": "Paris", "people": 2100000}')
        parsed = await sdk.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "A city?"}],
            response_format=City,
        )
        assert parsed.choices[0].message.parsed == City(name="Paris", people=2100000)
        grammar = script.params[0].grammar
        assert grammar is not None
        assert grammar.kind == "json_schema"
        schema = json.loads(grammar.source)
        assert schema["properties"] == City.model_json_schema()["properties"]

    async def test_json_object_is_a_grammar(
        self, client: tuple[Served, openai.AsyncOpenAI], script: Script
    ) -> None:
        _, sdk = client
        script.pieces = ["{}"]
        await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON please"}],
            response_format={"type": "json_object"},
        )
        assert script.params[0].grammar == Grammar("json_object")

    @pytest.mark.parametrize(
        "schema",
        [
            {"type": "foo"},
            {"type": "string", "pattern": "("},
            {"$ref": "#/definitions/missing"},
        ],
    )
    async def test_a_schema_that_cannot_be_used_is_a_400(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        schema: dict[str, Any],
    ) -> None:
        served, _ = client
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
        response = await served.chat(body)
        assert_error(response, 400, "response_format", "invalid_json_schema")
        assert script.params == []


class TestReasoning:
    async def test_thinking_goes_to_reasoning_content(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        template: Callable[[str], None],
    ) -> None:
        template(QWEN3_TEMPLATE)
        script.pieces = pieces("<think>\nLet me think.\n</think>\n\nParis.", 2)
        whole, chunks = await both(client, messages=[{"role": "user", "content": "?"}])
        message = whole.choices[0].message
        assert message.content == "Paris."
        assert message.model_extra == {"reasoning_content": "Let me think."}
        streamed = reassemble(chunks)
        assert (streamed["content"], streamed["reasoning"]) == (
            "Paris.",
            "Let me think.",
        )

    async def test_a_constrained_answer_has_no_reasoning(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        template: Callable[[str], None],
    ) -> None:
        # A template that opens <think> itself would put a JSON answer, forced
        # from its first token, all into the reasoning.
        _, sdk = client
        template(
            QWEN3_TEMPLATE.replace(
                "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
            )
        )
        script.pieces = ['{"a": 1}']
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "?"}],
            response_format={"type": "json_object"},
        )
        assert whole.choices[0].message.content == '{"a": 1}'
        assert not whole.choices[0].message.model_extra
        script.pieces = ["a</think>b"]
        whole = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "?"}]
        )
        assert whole.choices[0].message.content == "b"

    async def test_template_kwargs_reach_the_engine(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        template: Callable[[str], None],
    ) -> None:
        _, sdk = client
        template(QWEN3_TEMPLATE)
        script.pieces = ["Paris."]
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "?"}],
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert script.params[0].template_kwargs == (("enable_thinking", False),)
        assert whole.choices[0].message.content == "Paris."
        assert not whole.choices[0].message.model_extra

    async def test_streamed_logprobs_stay_one_chunk_per_token(
        self,
        client: tuple[Served, openai.AsyncOpenAI],
        script: Script,
        template: Callable[[str], None],
    ) -> None:
        served, _ = client
        template(QWEN3_TEMPLATE)
        script.pieces = ["<th", "ink>", "a", "</think>", "b"]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "?"}],
            "stream": True,
            "logprobs": True,
        }
        events = sse_events((await served.chat(body)).text)
        tokens = [
            entry["token"]
            for event in events[1:]
            if isinstance(event, dict) and event["choices"]
            for entry in (event["choices"][0]["logprobs"] or {}).get("content") or []
        ]
        assert tokens == script.pieces


class TestTinyModelTemplate:
    """The test model's chat template renders tools as Qwen3's does, so the
    engine's tests and the demo exercise the real prompt shape."""

    @pytest.fixture
    def render(self, tiny_model_path: Any) -> Callable[..., str]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))

        def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
            text: str = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
            return text

        return render

    def test_tools_calls_and_results_render_in_hermes_format(
        self, render: Callable[..., str]
    ) -> None:
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "get_time", "arguments": {"zone": "UTC"}},
        }
        text = render(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "noon", "tool_call_id": "c"},
            ],
            tools=[TIME],
        )
        assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
        assert json.dumps(TIME) in text
        assert (
            "<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
            "</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        ) in text
        assert text.count("Be brief.") == 1

    def test_enable_thinking_true_opens_the_reasoning(
        self, render: Callable[..., str]
    ) -> None:
        messages = [{"role": "user", "content": "Hi"}]
        plain = render(messages)
        assert plain.endswith("<|im_start|>assistant\n")
        assert render(messages, enable_thinking=False) == plain
        assert render(messages, enable_thinking=True) == plain + "<think>\n"

    def test_its_formats_are_recognised(self) -> None:
        from mlx_pinned.server.formats import model_formats
        from mlx_pinned.testing import _CHAT_TEMPLATE

        formats = model_formats(_CHAT_TEMPLATE)
        assert formats.tool_call is not None
        assert formats.tool_call.name == "hermes"
        assert formats.reasoning is not None
        assert formats.reasoning.name == "think"
        assert not formats.reasoning.opens(_CHAT_TEMPLATE, {})
        assert formats.reasoning.opens(_CHAT_TEMPLATE, {"enable_thinking": True})
