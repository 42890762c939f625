"""Every tiny tool family's forced calls through every door of a real
server (``serve`` in a subprocess, driven by the official ``openai`` and
``anthropic`` SDKs): chat ``tool_calls`` deltas, Responses
``function_call_arguments.delta`` events and Anthropic ``input_json_delta``
events each join to exactly the whole call; ``required`` (``any``) with
parallel calls allowed ends with its calls; no markup reaches a content
field."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from mlx_pinned.server.events import FinalEvent, GenerationParams, TokenEvent
from mlx_pinned.server.formats.blocks import MAX_FORCED_CALLS
from mlx_pinned.testing import TINY_TOOL_LM_TYPES, tiny_lm_path

from .conftest import replace_generation, sse_events
from .format_cases import CASES, Case
from .kit import (
    CLOCK,
    WEATHER,
    Serve,
    Served,
    Server,
    assert_no_markup,
    join_chat_chunks,
    running,
)

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
PROMPT = "What is the weather in Paris?"
# Room for every call a parallel forced answer may hold (a random model
# writes them all: about 50 tokens each).
MAX_TOKENS = 60 * MAX_FORCED_CALLS
FUNCTIONS = [WEATHER["function"], CLOCK["function"]]
SCHEMAS = {f["name"]: f["parameters"] for f in FUNCTIONS}


@dataclass
class Answer:
    """One answer at any door: its calls (name, arguments as JSON text, or
    the parsed input for Anthropic), its texts and how it ended."""

    calls: list[tuple[str, Any]]
    texts: list[str] = field(default_factory=list)
    finish: str | None = None


@pytest.fixture(scope="module", params=TINY_TOOL_LM_TYPES)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    family: str = request.param
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += [str(tiny_lm_path(family)), "--served-model-name", MODEL]
    command += ["--port", "0", "--max-tokens-limit", "4000"]
    with running(command, tmp_path_factory.mktemp(family) / "server.log") as served:
        yield served


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as sdk:
        yield sdk


@pytest.fixture
def claude(server: Server) -> Iterator[anthropic.Anthropic]:
    with server.anthropic_client() as sdk:
        yield sdk


def assert_valid(answer: Answer, *, parallel: bool, named: str | None) -> None:
    """The answer is its forced calls, each valid for its tool, and no
    markup in any text."""
    assert answer.calls, answer
    assert len(answer.calls) <= (MAX_FORCED_CALLS if parallel else 1), answer
    for name, arguments in answer.calls:
        assert name == named if named else name in SCHEMAS, answer
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
        jsonschema.validate(value, SCHEMAS[name])
    assert_no_markup(*answer.texts, context=answer)


# Each forced choice: how each door says it, whether parallel calls are
# allowed, and the one tool it names.
CHOICES = {
    "required": (True, None),
    "required-one": (False, None),
    "named": (False, "get_weather"),
}


def chat_choice(choice: str) -> dict[str, Any]:
    parallel, named = CHOICES[choice]
    forced: Any = {"type": "function", "function": {"name": named}} if named else None
    return {"tool_choice": forced or "required", "parallel_tool_calls": parallel}


def chat(
    client: openai.OpenAI, choice: str, limit: int = MAX_TOKENS
) -> tuple[Answer, Answer]:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [WEATHER, CLOCK],
        "max_tokens": limit,
        "temperature": 0,
        **chat_choice(choice),
    }
    reply = client.chat.completions.create(**fields).choices[0]
    whole = Answer(
        [
            (c.function.name, c.function.arguments)
            for c in reply.message.tool_calls or []
        ],
        [reply.message.content or ""],
        reply.finish_reason,
    )
    joined = join_chat_chunks(client.chat.completions.create(**fields, stream=True))
    streamed = Answer(list(joined.calls), [joined.content], joined.finish)
    return whole, streamed


def responses(
    client: openai.OpenAI, choice: str, limit: int = MAX_TOKENS
) -> tuple[Answer, Answer, Answer]:
    parallel, named = CHOICES[choice]
    fields: dict[str, Any] = {
        "model": MODEL,
        "input": PROMPT,
        "tools": [{"type": "function", **f} for f in FUNCTIONS],
        "tool_choice": {"type": "function", "name": named} if named else "required",
        "parallel_tool_calls": parallel,
        "max_output_tokens": limit,
        "temperature": 0,
    }
    whole = response_answer(client.responses.create(**fields))
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    done: dict[int, str] = {}
    texts: list[str] = []
    last: Any = None
    with client.responses.stream(**fields) as stream:
        for event in stream:
            if event.type == "response.output_item.added":
                if event.item.type == "function_call":
                    names[event.output_index] = event.item.name
                    arguments[event.output_index] = ""
            elif event.type == "response.function_call_arguments.delta":
                arguments[event.output_index] += event.delta
            elif event.type == "response.function_call_arguments.done":
                done[event.output_index] = event.arguments
            elif event.type in (
                "response.output_text.delta",
                "response.reasoning_text.delta",
            ):
                texts.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                # The SDK's get_final_response knows response.completed only.
                last = event.response
    final = response_answer(last)
    assert done == arguments
    streamed = Answer([(names[i], arguments[i]) for i in sorted(names)])
    streamed.texts, streamed.finish = ["".join(texts)], final.finish
    return whole, streamed, final


def response_answer(response: Any) -> Answer:
    calls = [
        (item.name, item.arguments)
        for item in response.output
        if item.type == "function_call"
    ]
    texts = [
        part.text
        for item in response.output
        if item.type in ("message", "reasoning")
        for part in item.content or []
    ]
    return Answer(calls, ["".join(texts)], response.status)


def messages(
    claude: anthropic.Anthropic, choice: str, limit: int = MAX_TOKENS
) -> tuple[Answer, Answer]:
    parallel, named = CHOICES[choice]
    forced: dict[str, Any] = (
        {"type": "tool", "name": named} if named else {"type": "any"}
    )
    if not parallel:
        forced["disable_parallel_tool_use"] = True
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": limit,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [
            {"name": f["name"], "input_schema": f["parameters"]} for f in FUNCTIONS
        ],
        "tool_choice": forced,
        "extra_body": {"temperature": 0},
    }
    whole = message_answer(claude.messages.create(**fields))
    names: dict[int, str] = {}
    partial: dict[int, str] = {}
    texts: list[str] = []
    with claude.messages.stream(**fields) as stream:
        for event in stream:
            if event.type == "content_block_start":
                if event.content_block.type == "tool_use":
                    names[event.index] = event.content_block.name
                    partial[event.index] = ""
            elif event.type == "content_block_delta":
                if event.delta.type == "input_json_delta":
                    partial[event.index] += event.delta.partial_json
                elif event.delta.type == "text_delta":
                    texts.append(event.delta.text)
                elif event.delta.type == "thinking_delta":
                    texts.append(event.delta.thinking)
        final = message_answer(stream.get_final_message())
    assert final == whole
    streamed = Answer([(names[i], json.loads(partial[i])) for i in sorted(names)])
    streamed.texts, streamed.finish = ["".join(texts)], final.finish
    return whole, streamed


def message_answer(message: Any) -> Answer:
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    texts = [
        getattr(b, "text", None) or getattr(b, "thinking", None) or ""
        for b in message.content
        if b.type in ("text", "thinking")
    ]
    return Answer(calls, ["".join(texts)], message.stop_reason)


@pytest.mark.slow
@pytest.mark.parametrize("choice", list(CHOICES))
class TestForcedCallsAtEveryDoor:
    def test_chat_completions_deltas_join_to_the_whole_calls(
        self, client: openai.OpenAI, choice: str
    ) -> None:
        parallel, named = CHOICES[choice]
        whole, streamed = chat(client, choice)
        assert whole.finish == "tool_calls", whole
        assert_valid(whole, parallel=parallel, named=named)
        assert streamed == whole

    def test_responses_argument_deltas_join_to_the_whole_calls(
        self, client: openai.OpenAI, choice: str
    ) -> None:
        parallel, named = CHOICES[choice]
        whole, streamed, final = responses(client, choice)
        assert whole.finish == "completed", whole
        assert_valid(whole, parallel=parallel, named=named)
        assert streamed == whole
        assert final == whole

    def test_anthropic_input_json_deltas_join_to_the_whole_calls(
        self, claude: anthropic.Anthropic, choice: str
    ) -> None:
        parallel, named = CHOICES[choice]
        whole, streamed = messages(claude, choice)
        assert whole.finish == "tool_use", whole
        assert_valid(whole, parallel=parallel, named=named)
        assert streamed == whole


@pytest.mark.slow
@pytest.mark.parametrize("limit", [3, 12])
def test_a_forced_call_cut_by_the_token_limit_leaves_no_markup_at_any_door(
    client: openai.OpenAI, claude: anthropic.Anthropic, limit: int
) -> None:
    # Cut in the call's opening markup, or in its head: no call, no text.
    chat_whole, chat_streamed = chat(client, "required", limit)
    whole, streamed, final = responses(client, "required", limit)
    message, message_streamed = messages(claude, "required", limit)
    assert (chat_whole.finish, whole.finish, message.finish) == (
        "length",
        "incomplete",
        "max_tokens",
    )
    assert chat_streamed == chat_whole
    assert streamed == whole == final
    assert message_streamed == message
    for answer in (chat_whole, whole, message):
        assert_no_markup(*answer.texts, context=answer)


@pytest.mark.slow
def test_every_door_forces_the_same_named_call(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    # The same greedy prompt at each door, in the model's own syntax: one call.
    chat_calls = [(n, json.loads(a)) for n, a in chat(client, "named")[0].calls]
    response_calls = [
        (n, json.loads(a)) for n, a in responses(client, "named")[0].calls
    ]
    assert chat_calls == response_calls == messages(claude, "named")[0].calls


# Every format's answer with text around its calls, scripted (the engine's
# generation replaced, so the text is the format's own, whatever the model):
# each door keeps the text as content and gives the calls whole, streamed
# or not. Harmony's calls come through its reasoning format's splitter.
HARMONY = Case(
    "harmony",
    "<|channel|>analysis<|message|>Let me look.<|end|><|start|>assistant"
    "<|channel|>commentary<|message|>Checking the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_time "
    '<|constrain|>json<|message|>{"zone": "UTC"}<|call|>',
    "Checking the weather.",
    [("get_time", {"zone": "UTC"})],
    (),
)
SCRIPTED = [*CASES, HARMONY]


class Script:
    """The engine's generation, scripted: ``text`` in pieces of three
    characters, then the end of the turn."""

    def __init__(self) -> None:
        self.text = ""

    def __call__(
        self, loaded: Any, params: GenerationParams, images: Any
    ) -> Iterator[TokenEvent | FinalEvent]:
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)]
        for piece in pieces:
            yield TokenEvent(piece, None)
        yield FinalEvent("", "stop", 3, len(pieces))


def sse_named(text: str) -> list[dict[str, Any]]:
    """The data of each named server-sent event (its name is its type)."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        events.append(event)
    return events


def functions(case: Case) -> list[dict[str, Any]]:
    """The case's tools, as functions (name and parameters)."""
    return [{"name": t.name, "parameters": t.parameters} for t in case.tools]


async def scripted_responses(served: Served, case: Case) -> tuple[Answer, Answer]:
    body = {
        "model": MODEL,
        "input": PROMPT,
        "tools": [{"type": "function", **f} for f in functions(case)],
    }
    whole = (await served.client.post("/v1/responses", json=body)).json()
    answer = Answer(
        [
            (item["name"], json.loads(item["arguments"]))
            for item in whole["output"]
            if item["type"] == "function_call"
        ],
        [
            part["text"]
            for item in whole["output"]
            if item["type"] == "message"
            for part in item["content"]
        ],
        whole["status"],
    )
    streamed = await served.client.post("/v1/responses", json={**body, "stream": True})
    events = sse_named(streamed.text)
    arguments: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for event in events:
        if event["type"] == "response.output_item.added":
            if event["item"]["type"] == "function_call":
                arguments[event["output_index"]] = [event["item"]["name"], ""]
        elif event["type"] == "response.function_call_arguments.delta":
            arguments[event["output_index"]][1] += event["delta"]
        elif event["type"] == "response.output_text.delta":
            texts[event["output_index"]] = (
                texts.get(event["output_index"], "") + event["delta"]
            )
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(whole["output"])
    stream = Answer(
        [(n, json.loads(a)) for n, a in (arguments[i] for i in sorted(arguments))],
        [texts[i] for i in sorted(texts)],
        final["status"],
    )
    return answer, stream


def without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output
    ]


async def scripted_messages(served: Served, case: Case) -> tuple[Answer, Answer]:
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [
            {"name": f["name"], "input_schema": f["parameters"]}
            for f in functions(case)
        ],
    }
    whole = (await served.client.post("/v1/messages", json=body)).json()
    answer = Answer(
        [(b["name"], b["input"]) for b in whole["content"] if b["type"] == "tool_use"],
        [b["text"] for b in whole["content"] if b["type"] == "text"],
        whole["stop_reason"],
    )
    streamed = await served.client.post("/v1/messages", json={**body, "stream": True})
    calls: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    finish = None
    for event in sse_named(streamed.text):
        if event["type"] == "content_block_start":
            if event["content_block"]["type"] == "tool_use":
                calls[event["index"]] = [event["content_block"]["name"], ""]
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "input_json_delta":
                calls[event["index"]][1] += delta["partial_json"]
            elif delta["type"] == "text_delta":
                texts[event["index"]] = texts.get(event["index"], "") + delta["text"]
        elif event["type"] == "message_delta":
            finish = event["delta"]["stop_reason"]
    stream = Answer(
        [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))],
        [texts[i] for i in sorted(texts)],
        finish,
    )
    return answer, stream


async def scripted_chat(served: Served, case: Case) -> tuple[Answer, Answer]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"type": "function", "function": f} for f in functions(case)],
    }
    whole = (await served.chat(body)).json()["choices"][0]
    answer = Answer(
        [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["message"].get("tool_calls") or []
        ],
        [whole["message"]["content"] or ""],
        whole["finish_reason"],
    )
    streamed = await served.chat({**body, "stream": True})
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] = call["function"].get("name") or entry[0]
                entry[1] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    stream = Answer(
        [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))],
        [content],
        finish,
    )
    return answer, stream


@pytest.mark.anyio
@pytest.mark.parametrize(
    "case", SCRIPTED, ids=[f"{c.format}-{i}" for i, c in enumerate(SCRIPTED)]
)
async def test_text_around_calls_stays_content_at_every_door(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, case: Case
) -> None:
    script = Script()
    script.text = case.text
    replace_generation(monkeypatch, script)
    reasoning = "harmony" if case.format == "harmony" else "none"
    async with serve(tool_call_parser=case.format, reasoning_parser=reasoning) as app:
        doors = {
            "chat": (await scripted_chat(app, case), "tool_calls"),
            "responses": (await scripted_responses(app, case), "completed"),
            "messages": (await scripted_messages(app, case), "tool_use"),
        }
    for door, ((whole, streamed), finish) in doors.items():
        assert streamed == whole, door
        assert whole.calls == case.calls, door
        assert "".join(whole.texts) == case.content, door
        assert whole.finish == finish, door
        assert_no_markup(*whole.texts, context=door)
