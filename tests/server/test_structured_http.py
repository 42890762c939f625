"""Structured outputs and forced tool calls end to end on the tiny
random-weight model, through the official openai SDK: the grammar makes even
random weights answer valid JSON and valid calls, in one batch with free
requests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from .conftest import MODEL, Served, sse_events

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

Serve = Callable[..., AbstractAsyncContextManager[Served]]

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
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Describe this image in one sentence."}]


@pytest.fixture
async def served(serve: Serve) -> AsyncIterator[tuple[Served, openai.AsyncOpenAI]]:
    async with serve(max_num_seqs=16) as running:
        sdk = openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key="unused",
            http_client=running.client,
            max_retries=0,
        )
        yield running, sdk


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}


def check_calls(message: Any) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        tool = SCHEMAS[call.function.name]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, tool["function"]["parameters"])


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

    async def test_sixteen_mixed_requests_in_one_batch(
        self, served: tuple[Served, openai.AsyncOpenAI]
    ) -> None:
        _, sdk = served
        replies: dict[int, Any] = {}

        async def ask(i: int) -> None:
            extra: dict[str, Any] = {}
            if i % 3 == 0:
                extra["response_format"] = schema_format(CITY)
            elif i % 3 == 1:
                extra["tools"] = [WEATHER, CLOCK]
                extra["tool_choice"] = "required"
                extra["parallel_tool_calls"] = False
            replies[i] = await sdk.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=200,
                temperature=1.0,
                seed=i,
                **extra,
            )

        async with anyio.create_task_group() as group:
            for i in range(16):
                group.start_soon(ask, i)
        for i, reply in replies.items():
            choice = reply.choices[0]
            if i % 3 == 0:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content or ""), CITY)
            elif i % 3 == 1:
                assert choice.finish_reason == "tool_calls"
                check_calls(choice.message)
            else:
                assert choice.message.tool_calls is None


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
