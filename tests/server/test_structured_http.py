"""Structured outputs and forced tool calls end to end on the tiny
random-weight model, through the official openai SDK: the grammar makes even
random weights answer valid JSON and valid calls, in one batch with free
requests."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionChunk

from mlx_pinned.server import grammars
from mlx_pinned.server.cli import DEMO_MODEL_NAME
from mlx_pinned.server.events import Grammar

from .conftest import MODEL, sse_events
from .kit import CLOCK, TOL, WEATHER, Serve, Served, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "people": {"type": "integer", "minimum": 0, "maximum": 9999},
        "rainy": {"type": "boolean"},
    },
    "required": ["name", "people", "rainy"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Describe this image in one sentence."}]


@pytest.fixture
async def served(serve: Serve) -> AsyncIterator[tuple[Served, openai.AsyncOpenAI]]:
    async with serve(max_num_seqs=16) as running:
        yield running, running.sdk()


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}


def check_calls(message: Any) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        tool = SCHEMAS[call.function.name]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, tool["function"]["parameters"])


@dataclasses.dataclass
class Answer:
    """What a completion said, read the same way streamed or not."""

    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments)
    finish: str | None
    logprobs: list[float]


async def answer(sdk: openai.AsyncOpenAI, *, stream: bool, **fields: Any) -> Answer:
    """A completion through the SDK; streamed, joined from its deltas."""
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, **fields}
    if not stream:
        reply = await sdk.chat.completions.create(**request)
        choice = reply.choices[0]
        calls = [
            (call.function.name, call.function.arguments)
            for call in choice.message.tool_calls or []
        ]
        logprobs = choice.logprobs.content if choice.logprobs else None
        return Answer(
            choice.message.content,
            calls,
            choice.finish_reason,
            [t.logprob for t in logprobs or []],
        )
    content: str | None = None
    parts: dict[int, list[str]] = {}
    finish: str | None = None
    values: list[float] = []
    async with await sdk.chat.completions.create(stream=True, **request) as chunks:
        async for chunk in chunks:
            for delta_choice in chunk.choices:
                delta = delta_choice.delta
                if delta.content:
                    content = (content or "") + delta.content
                for call in delta.tool_calls or []:
                    entry = parts.setdefault(call.index, ["", ""])
                    if call.function and call.function.name:
                        entry[0] = call.function.name
                    entry[1] += (call.function and call.function.arguments) or ""
                if delta_choice.logprobs and delta_choice.logprobs.content:
                    values += [t.logprob for t in delta_choice.logprobs.content]
                finish = delta_choice.finish_reason or finish
    calls = [(parts[i][0], parts[i][1]) for i in sorted(parts)]
    return Answer(content, calls, finish, values)


async def streamed(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    """A stream's content and calls, joined from its deltas."""
    response = await served.chat({**body, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]", events[-3:]
    content, calls, finish = "", {}, None
    for event in events[:-1]:
        chunk = ChatCompletionChunk.model_validate(event)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.function and call.function.name:
                    entry[0] = call.function.name
                entry[1] += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


class TestStructuredOutputs:
    async def test_a_json_schema_answer_validates(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0,
            response_format=schema_format(CITY),  # type: ignore[arg-type]
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), CITY)

    @pytest.mark.parametrize("forced", [False, True])
    async def test_a_grammar_is_compiled_once_for_the_check_and_the_engine(
        self,
        served: tuple[Served, openai.AsyncOpenAI],
        monkeypatch: pytest.MonkeyPatch,
        forced: bool,
    ) -> None:
        compiled: list[Grammar] = []
        compile_one = grammars._compile

        def counted(grammar: Grammar) -> tuple[str, str]:
            compiled.append(grammar)
            return compile_one(grammar)

        monkeypatch.setattr(grammars, "_compile", counted)
        # A schema no other run sends, so neither side has it cached.
        schema = {**CITY, "title": uuid.uuid4().hex}
        fields: dict[str, Any] = {"response_format": schema_format(schema)}
        if forced:
            tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
            fields = {"tools": [tool], "tool_choice": "required"}
        running, _ = served
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}
        response = await running.chat(body)
        assert response.status_code == 200, response.text
        # The schema (a forced call's, and its call's Lark grammar) once
        # each: the HTTP check's compile is the one the engine's matcher uses.
        assert [g.kind for g in compiled] == (
            ["json_schema", "lark"] if forced else ["json_schema"]
        )
        assert len(set(compiled)) == len(compiled)

    async def test_json_object_is_an_object(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_object"},
        )
        text = reply.choices[0].message.content or ""
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")

    @pytest.mark.slow
    async def test_a_required_call_validates_and_streams_the_same(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        running, sdk = served
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 200,
            "temperature": 0,
            "tools": [WEATHER, CLOCK],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        reply = await sdk.chat.completions.create(**body)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        check_calls(choice.message)
        assert len(choice.message.tool_calls or []) == 1
        stream = await streamed(running, body)
        assert stream["finish"] == "tool_calls"
        assert stream["content"] == ""
        assert stream["calls"] == [
            [c.function.name, c.function.arguments]
            for c in choice.message.tool_calls or []
        ]

    async def test_a_named_function_is_called(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0,
            tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
        )
        message = reply.choices[0].message
        check_calls(message)
        assert [c.function.name for c in message.tool_calls or []] == ["get_time"]

    async def test_parallel_calls_cut_by_length_are_valid_but_the_last(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        # Random weights never choose to stop calling: the answer ends at
        # max_tokens, in the middle of a call.
        _, sdk = served
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0,
            tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice="required",
        )
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "length":
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls"
        for call in calls:
            parameters = SCHEMAS[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), parameters)

    # asyncio only: the SDK's async stream leaves its httpx generators to the
    # garbage collector, which trio reports as a ResourceWarning (an error).
    @pytest.mark.slow
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_sixteen_mixed_requests_in_one_batch(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        # Eight kinds of request, each streamed and not, greedy: the two of a
        # kind must answer alike, whatever their neighbours in the batch.
        running, sdk = served
        kinds: dict[str, dict[str, Any]] = {
            "schema": {"response_format": schema_format(CITY)},
            "object": {"response_format": {"type": "json_object"}},
            "required": {"tools": [WEATHER, CLOCK], "tool_choice": "required"},
            "named": {
                "tools": [WEATHER, CLOCK],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            "free": {"logprobs": True},
            "presence": {"presence_penalty": 2.0},
            "frequency": {"frequency_penalty": 2.0},
            "repetition": {"extra_body": {"repetition_penalty": 1.5}},
        }
        for name in ("required", "named"):
            kinds[name]["parallel_tool_calls"] = False
        answers: dict[tuple[str, bool], Answer] = {}

        # Schemas and calls end by themselves; the others at max_tokens.
        ends = ("schema", "required", "named")

        async def ask(name: str, stream: bool) -> None:
            tokens = 120 if name in ends else 40
            fields = {"max_tokens": tokens, "temperature": 0, **kinds[name]}
            answers[name, stream] = await answer(sdk, stream=stream, **fields)

        # Holding the MLX thread until all sixteen generations are queued
        # makes their first turns run together: one prefill, one batch.
        thread = running.thread

        def hold() -> None:
            deadline = time.monotonic() + 60
            while thread.statistics().pending < 16 and time.monotonic() < deadline:
                time.sleep(0.002)

        held = thread.submit(hold)
        async with anyio.create_task_group() as group:
            for name in kinds:
                for stream in (False, True):
                    group.start_soon(ask, name, stream)
        held.result()
        assert running.engine.statistics().peak_active == 16
        for name in kinds:
            assert answers[name, True] == answers[name, False], name
        schema = answers["schema", False]
        assert schema.finish == "stop"
        jsonschema.validate(json.loads(schema.content or ""), CITY)
        text = answers["object", False].content or ""
        assert text.startswith("{")
        if answers["object", False].finish == "stop":
            assert isinstance(json.loads(text), dict)
        for name, called in (("required", None), ("named", "get_time")):
            reply = answers[name, False]
            assert reply.finish == "tool_calls"
            assert reply.content is None
            assert len(reply.calls) == 1
            call_name, arguments = reply.calls[0]
            assert called in (None, call_name)
            jsonschema.validate(
                json.loads(arguments), SCHEMAS[call_name]["function"]["parameters"]
            )
        # Penalties are per row: each changes its own answer, and the free
        # row beside them answers as it does alone.
        free = answers["free", False]
        for name in ("presence", "frequency", "repetition"):
            assert answers[name, False].content != free.content, name
        alone = await answer(
            sdk, stream=False, max_tokens=40, temperature=0, logprobs=True
        )
        assert alone.content == free.content
        assert alone.logprobs == pytest.approx(free.logprobs, abs=TOL)


class Scene(pydantic.BaseModel):
    """What the SDK's ``parse`` asks for: a schema from a pydantic model."""

    caption: str = pydantic.Field(max_length=16)
    count: int = pydantic.Field(ge=0, le=9)


@pytest.mark.slow
class TestThroughUvicorn:
    """The SDK against ``serve --demo`` in a subprocess (real uvicorn)."""

    @pytest.mark.parametrize("anyio_backend", ["asyncio"])  # as the test above
    async def test_parse_and_a_forced_call_streamed_and_not(
        self, tmp_path: Path
    ) -> None:
        call = {
            "model": DEMO_MODEL_NAME,
            "max_tokens": 120,
            "temperature": 0,
            "tools": [WEATHER, CLOCK],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        with running_server(tmp_path / "server.log") as server:
            async with server.async_client() as sdk:
                parsed = await sdk.chat.completions.parse(
                    model=DEMO_MODEL_NAME,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=120,
                    temperature=0,
                    response_format=Scene,
                )
                whole = await answer(sdk, stream=False, **call)
                streamed = await answer(sdk, stream=True, **call)
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Scene)
        assert whole.finish == "tool_calls"
        name, arguments = whole.calls[0]
        jsonschema.validate(
            json.loads(arguments), SCHEMAS[name]["function"]["parameters"]
        )
        assert streamed == whole


@pytest.mark.slow
class TestPenalties:
    async def test_penalties_change_the_repetitive_answer(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served

        async def text(**fields: Any) -> str:
            reply = await sdk.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=24,
                temperature=0,
                **fields,
            )
            return reply.choices[0].message.content or ""

        plain = await text()
        assert await text(presence_penalty=2.0) != plain
        assert await text(frequency_penalty=2.0) != plain
        assert await text(extra_body={"repetition_penalty": 1.5}) != plain


class TestTheTemplate:
    async def prompt_tokens(self, sdk: openai.AsyncOpenAI, **fields: Any) -> int:
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=1,
            **fields,
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    async def test_tools_reach_the_template(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served
        plain = await self.prompt_tokens(sdk)
        assert await self.prompt_tokens(sdk, tools=[WEATHER]) > plain + 50
        assert await self.prompt_tokens(sdk, tools=[WEATHER], tool_choice="none") == (
            plain
        )

    async def test_template_kwargs_reach_the_template(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served
        plain = await self.prompt_tokens(sdk)
        thinking = {"chat_template_kwargs": {"enable_thinking": True}}
        assert await self.prompt_tokens(sdk, extra_body=thinking) > plain

    async def test_a_thinking_answer_is_reasoning(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        # The tiny template opens <think> when asked; random weights never
        # close it, so the whole answer is reasoning.
        _, sdk = served
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        message = reply.choices[0].message
        assert message.content == ""
        assert (message.model_extra or {}).get("reasoning_content")
