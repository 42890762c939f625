"""``/v1/responses`` end to end: a real uvicorn server on the tiny model,
driven by the official ``openai`` SDK, the OpenAI Agents SDK and Codex."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from mlx_pinned.server.cli import DEMO_MODEL_NAME
from mlx_pinned.server.events import FinalEvent, GenerationParams, TokenEvent
from mlx_pinned.server.http.errors import APIError
from mlx_pinned.server.http.responses_api.items import INPUT_ITEMS, chat_messages
from mlx_pinned.server.http.responses_api.objects import Output
from mlx_pinned.server.http.responses_api.route import StreamErrors
from mlx_pinned.testing import image_data_uri, tiny_vlm_path

from .conftest import MODEL, replace_generation
from .kit import Server, running

pytestmark = pytest.mark.timeout(180)

#: Codex at the version FACTS.md measured; .ci/run installs it here.
CODEX_VERSION = "0.169.0"
NPM_CACHE = (
    Path(os.environ.get("MLX_PINNED_CACHE", Path.home() / ".cache" / "mlx-pinned"))
    / "npm"
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@contextmanager
def serving(log: Path, *options: str, model: Path | None = None) -> Iterator[Server]:
    """``serve`` of the demo model (or ``model``, under the demo's name) on a
    free loopback port, until it is killed."""
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    if model is None:
        command.append("--demo")
    else:
        command += [str(model), "--served-model-name", DEMO_MODEL_NAME]
    command += ["--port", "0", "--max-tokens-limit", "4000", *options]
    with running(command, log) as served:
        yield served


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("responses") / "server.log") as served:
        yield served


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    """An SDK client of the server, closed after the test (an unclosed one's
    socket is a ResourceWarning whenever it is collected)."""
    with server.client() as sdk:
        yield sdk


@pytest.mark.slow
def test_create_answers_a_response_object(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEMO_MODEL_NAME, input="Say hi.", max_output_tokens=8
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 8


def test_same_greedy_prompt_same_text_as_chat_completions(
    client: openai.OpenAI,
) -> None:
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        instructions="Be brief.",
        input="Describe a cat.",
        temperature=0,
        max_output_tokens=24,
    )
    chat = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Describe a cat."},
        ],
        temperature=0,
        max_tokens=24,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None
    assert chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_an_image_is_read(client: openai.OpenAI) -> None:
    content: Any = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": image_data_uri(64, 64)},
    ]
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        input=[{"role": "user", "content": content}],
        max_output_tokens=4,
    )
    text_only = client.responses.create(
        model=DEMO_MODEL_NAME,
        input=[{"role": "user", "content": content[:1]}],
        max_output_tokens=4,
    )
    assert response.usage is not None
    assert text_only.usage is not None
    assert response.usage.input_tokens > text_only.usage.input_tokens


def test_stream_events_rebuild_the_whole_response(client: openai.OpenAI) -> None:
    kinds: list[str] = []
    numbers: list[int] = []
    deltas: list[str] = []
    with client.responses.stream(
        model=DEMO_MODEL_NAME, input="Describe a cat.", max_output_tokens=16
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type == "response.incomplete":
                # The SDK's get_final_response() waits for response.completed,
                # which an answer cut by max_output_tokens does not send.
                final = event.response
    assert numbers == list(range(len(numbers)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(deltas) == final.output_text
    assert final.output_text
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text


def test_previous_response_id_continues_with_the_prompt_cache(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model=DEMO_MODEL_NAME,
        instructions="You are terse.",
        input="Name a colour.",
        max_output_tokens=8,
        temperature=0,
    )
    second = client.responses.create(
        model=DEMO_MODEL_NAME,
        instructions="You are terse.",
        previous_response_id=first.id,
        input="And another one?",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None
    assert second.usage is not None
    # The whole first turn is the second's prefix, served from the cache.
    assert (
        second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    )
    assert second.usage.input_tokens_details.cached_tokens > 0
    # The same conversation sent whole renders the same prompt.
    replay = client.responses.create(
        model=DEMO_MODEL_NAME,
        instructions="You are terse.",
        input=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another one?"},
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert replay.usage is not None
    assert replay.usage.input_tokens == second.usage.input_tokens
    assert replay.output_text == second.output_text


def test_retrieve_delete_and_input_items(server: Server, client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=DEMO_MODEL_NAME, input="Hello there.", max_output_tokens=4
    )
    assert client.responses.retrieve(created.id).id == created.id
    items = client.responses.input_items.list(created.id)
    assert len(items.data) == 1
    first = items.data[0]
    assert first.type == "message"
    assert first.content[0].text == "Hello there."  # type: ignore[union-attr]
    deleted = httpx.delete(f"{server.url}/v1/responses/{created.id}")
    assert deleted.json() == {
        "id": created.id,
        "object": "response.deleted",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=DEMO_MODEL_NAME, previous_response_id=created.id, input="more"
        )


def test_metrics_count_the_routes_by_their_templates(
    server: Server, client: openai.OpenAI
) -> None:
    created = client.responses.create(
        model=DEMO_MODEL_NAME, input="Hi.", max_output_tokens=1
    )
    client.responses.retrieve(created.id)
    client.responses.input_items.list(created.id)
    metrics = httpx.get(f"{server.url}/metrics").text
    for route in (
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
    ):
        assert f'route="{route}",status="200"' in metrics
    assert created.id not in metrics


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=DEMO_MODEL_NAME, input="Hi.", max_output_tokens=2, store=False
    )
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


@pytest.mark.slow
def test_the_store_bound_from_the_command_line(tmp_path: Path) -> None:
    store_max = ("--responses-store-max", "1")
    with (
        serving(tmp_path / "server.log", *store_max) as served,
        served.client() as client,
    ):
        one = client.responses.create(
            model=DEMO_MODEL_NAME, input="one", max_output_tokens=1
        )
        two = client.responses.create(
            model=DEMO_MODEL_NAME, input="two", max_output_tokens=1
        )
        assert client.responses.retrieve(two.id).id == two.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(one.id)


@pytest.mark.slow
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}]
)
def test_a_forced_function_call_round_trip(client: openai.OpenAI, choice: Any) -> None:
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather"
    assert call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    answer = client.responses.create(
        model=DEMO_MODEL_NAME,
        previous_response_id=response.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        ],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert answer.status in ("completed", "incomplete")
    assert answer.usage is not None
    assert response.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens


@pytest.mark.slow
def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    arguments: list[str] = []
    with client.responses.stream(
        model=DEMO_MODEL_NAME,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=200,
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls
    assert "".join(arguments) == "".join(call.arguments for call in calls)
    json.loads(calls[0].arguments)


class Colour(BaseModel):
    # A choice, not free text: random weights never end a free string.
    name: Literal["red", "blue"]
    bright: bool


def test_parse_follows_the_schema(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=DEMO_MODEL_NAME,
        input="A colour, as JSON.",
        text_format=Colour,
        max_output_tokens=200,
    )
    assert isinstance(parsed.output_parsed, Colour)


def test_json_object_format(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEMO_MODEL_NAME,
        input="JSON please.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=20,
    )
    # Random weights write a string that never ends: the grammar shows in
    # how the text begins.
    assert response.output_text.startswith("{")


HOSTILE: list[Any] = [
    {"model": DEMO_MODEL_NAME, "input": "hi", "surprise": 1},
    {"model": DEMO_MODEL_NAME, "input": 5},
    {"model": DEMO_MODEL_NAME, "input": "hi", "max_output_tokens": "10"},
    {"model": DEMO_MODEL_NAME, "input": "hi", "max_output_tokens": 10**9},
    {"model": DEMO_MODEL_NAME, "input": "hi", "temperature": 9},
    {"model": DEMO_MODEL_NAME, "input": []},
    {"model": DEMO_MODEL_NAME, "input": [{"role": "user", "content": "x"}] * 5000},
    {"model": DEMO_MODEL_NAME, "input": [{"type": "nonsense"}]},
    {"model": DEMO_MODEL_NAME, "input": [{"role": "user", "content": [{"a": 1}]}]},
    {
        "model": DEMO_MODEL_NAME,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
                ],
            }
        ],
    },
    {
        "model": DEMO_MODEL_NAME,
        "input": [
            {"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}
        ],
    },
    {
        "model": DEMO_MODEL_NAME,
        "input": [{"role": "user", "content": [{"type": "input_image"}]}],
    },
    {"model": DEMO_MODEL_NAME, "input": [{"type": "web_search_call", "id": "ws"}]},
    {"model": DEMO_MODEL_NAME, "input": "hi", "tool_choice": {"type": "web_search"}},
    {"model": DEMO_MODEL_NAME, "input": "hi", "tool_choice": "required"},
    {"model": DEMO_MODEL_NAME, "input": "hi", "tools": [{"type": "function"}]},
    {"model": DEMO_MODEL_NAME, "input": "hi", "tools": [WEATHER] * 200},
    {"model": DEMO_MODEL_NAME, "input": "hi", "text": {"format": {"type": "yaml"}}},
    {"model": DEMO_MODEL_NAME, "input": "hi", "background": True},
    {"model": DEMO_MODEL_NAME, "input": "hi", "truncation": "auto"},
    {"model": DEMO_MODEL_NAME, "input": "hi", "previous_response_id": "resp_nope"},
    {"model": "no-such-model", "input": "hi"},
    {"model": DEMO_MODEL_NAME, "input": "hi", "metadata": {"a": {"b": 1}}},
]


@pytest.mark.slow
@pytest.mark.parametrize("body", HOSTILE)
def test_hostile_bodies_are_4xx(server: Server, body: Any) -> None:
    with server.http(timeout=60) as http:
        answer = http.post("/v1/responses", json=body)
    assert 400 <= answer.status_code < 500, answer.text
    assert answer.json()["error"]["message"]


def test_deep_nesting_is_a_4xx(server: Server) -> None:
    nested = "[" * 100_000 + "]" * 100_000
    body = f'{{"model": "{DEMO_MODEL_NAME}", "input": {nested}}}'
    with server.http(timeout=60) as http:
        answer = http.post(
            "/v1/responses", content=body, headers={"content-type": "application/json"}
        )
    assert 400 <= answer.status_code < 500


def test_an_unknown_field_is_named(server: Server) -> None:
    with server.http() as http:
        answer = http.post(
            "/v1/responses",
            json={"model": DEMO_MODEL_NAME, "input": "hi", "surprise": 1},
        )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "surprise"


def test_hosted_tools_are_accepted_and_not_shown(client: openai.OpenAI) -> None:
    plain = client.responses.create(
        model=DEMO_MODEL_NAME, input="hi", max_output_tokens=2, temperature=0
    )
    hosted = client.responses.create(
        model=DEMO_MODEL_NAME,
        input="hi",
        tools=[
            {"type": "web_search"},
            {  # type: ignore[list-item]
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Agents that work beside this one.",
                "tools": [{"type": "function", "name": "spawn_agent"}],
            },
        ],
        max_output_tokens=2,
        temperature=0,
    )
    assert plain.usage is not None
    assert hosted.usage is not None
    assert hosted.usage.input_tokens == plain.usage.input_tokens
    assert hosted.output_text == plain.output_text


@pytest.mark.slow
def test_agents_sdk_runner_with_a_function_tool(server: Server) -> None:
    import agents

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async def run() -> agents.RunResult:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0
        )
        async with client:
            model = agents.OpenAIResponsesModel(
                model=DEMO_MODEL_NAME, openai_client=client
            )
            agent = agents.Agent(
                name="weather",
                instructions="Use the tool.",
                model=model,
                tools=[get_weather],
                model_settings=agents.ModelSettings(
                    tool_choice="get_weather", max_tokens=200, parallel_tool_calls=False
                ),
                tool_use_behavior="stop_on_first_tool",
            )
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert len(calls) == 1
    assert result.final_output == "sunny"


def codex_binary() -> Path:
    """Codex from npm at :data:`CODEX_VERSION`, installed once into the cache."""
    prefix = NPM_CACHE / f"codex-{CODEX_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(prefix),
                f"@openai/codex@{CODEX_VERSION}",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return binary


def quiet_model(folder: Path) -> Path:
    """The tiny model, made to end its turn at once: with its final norm
    zeroed every logit is 0, so greedy decoding picks token 0, which is
    ``<|endoftext|>``, an end-of-turn token. Random weights never end a turn
    within a client's token budget, and Codex takes a ``response.incomplete``
    for an error."""
    import mlx.core as mx

    shutil.copytree(tiny_vlm_path(), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    norm = "language_model.model.norm.weight"
    weights[norm] = mx.zeros_like(weights[norm])
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_codex_exec_says_hi(tmp_path: Path) -> None:
    model = quiet_model(tmp_path / "quiet")
    with serving(tmp_path / "server.log", model=model) as server:
        run_codex(server, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_codex_resumes_its_conversation_after_a_restart(tmp_path: Path) -> None:
    """Codex's second turn, after the server was stopped and started again on
    the same ``--state-dir``, is answered, with the first turn in its
    prompt (Codex resends its conversation; what the server stored survives)."""
    model = quiet_model(tmp_path / "quiet")
    state = ("--state-dir", str(tmp_path / "state"))
    with serving(tmp_path / "first.log", *state, model=model) as server:
        first = run_codex(server, tmp_path, "say hi")
    with serving(tmp_path / "second.log", *state, model=model) as server:
        second = run_codex(server, tmp_path, "say bye", resume=True)
    # The first turn (its message and the answer's turn) is in the prompt:
    # more tokens than "say bye" and "say hi" differ by.
    assert prompt_tokens(second[0]) > prompt_tokens(first[-1]) + 4


def prompt_tokens(line: str) -> int:
    match = re.search(r" prompt=(\d+) ", line)
    assert match, line
    return int(match.group(1))


def run_codex(
    server: Server, tmp_path: Path, prompt: str = "say hi", *, resume: bool = False
) -> list[str]:
    """``codex exec`` (``resume --last``: its last session, continued)
    against ``server``; the log lines of its requests, all answered 200."""
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{DEMO_MODEL_NAME}"\n'
        'model_provider = "local"\n'
        "[model_providers.local]\n"
        'name = "local"\n'
        f'base_url = "{server.url}/v1"\n'
        'env_key = "LOCAL_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    before = len(server.log_text())
    env = {**os.environ, "HOME": str(home), "LOCAL_KEY": "x"}
    command = [str(codex_binary()), "exec", "--skip-git-repo-check"]
    command += ["resume", "--last", prompt] if resume else [prompt]
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    lines = server.log_text()[before:].splitlines()
    requests = [line for line in lines if "POST /v1/responses" in line]
    assert done.returncode == 0, done.stdout + done.stderr
    assert requests, "\n".join(lines)
    assert all(" 200 " in line for line in requests), "\n".join(requests)
    return requests


def test_items_become_the_chat_turns_templates_take() -> None:
    items = INPUT_ITEMS.validate_python(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "calling", "annotations": []}
                ],
                "status": "completed",
                "id": "msg_1",
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "f",
                "arguments": '{"a":1}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "f",
                "arguments": "oops",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
            {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
        ]
    )
    assert chat_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning_content": "think",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": 1}},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "f", "arguments": "oops"},
                },
            ],
        },
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]


def test_a_failure_in_a_stream_ends_it_with_response_failed() -> None:
    output = Output()
    head = {"id": "resp_1", "status": "in_progress", "output": [], "error": None}
    output.event("response.created", response=head)
    output.add(["some text"])
    data = StreamErrors(head, output).event(
        APIError(503, "The server is busy.", code="busy")
    )
    kind, body = data.decode().strip().split("\n")
    assert kind == "event: response.failed"
    event = json.loads(body.removeprefix("data: "))
    assert event["sequence_number"] == output.sequence - 1
    assert event["response"]["status"] == "failed"
    assert event["response"]["error"] == {
        "code": "busy",
        "message": "The server is busy.",
    }
    assert event["response"]["output"][0]["content"][0]["text"] == "some text"
    assert head["status"] == "in_progress"  # the response object itself is unchanged


def test_input_items_pages(server: Server, client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=DEMO_MODEL_NAME,
        input=[
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
        ],
        max_output_tokens=1,
    )
    url = f"/v1/responses/{created.id}/input_items"
    with server.http() as http:
        first = http.get(url, params={"limit": 2, "order": "asc"}).json()
        after = {"limit": 2, "order": "asc", "after": first["last_id"]}
        rest = http.get(url, params=after).json()
        newest = http.get(url).json()
        refused = [
            http.get(url, params=bad).status_code
            for bad in ({"limit": "0"}, {"limit": "x" * 50}, {"order": "sideways"})
        ]
    assert [item["content"][0]["text"] for item in first["data"]] == ["one", "two"]
    assert first["has_more"] is True
    assert [item["content"][0]["text"] for item in rest["data"]] == ["three"]
    assert rest["has_more"] is False
    assert newest["data"][0]["content"][0]["text"] == "three"
    assert refused == [400, 400, 400]


class Script:
    """The engine's generation, scripted: ``pieces`` as tokens, then the end
    (or ``fail`` raised after them); records the params it got."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.fail = False
        self.finish: Literal["stop", "length"] = "stop"
        self.params: list[GenerationParams] = []

    def __call__(
        self, loaded: Any, params: GenerationParams, images: Any
    ) -> Iterator[TokenEvent | FinalEvent]:
        self.params.append(params)
        for piece in self.pieces:
            yield TokenEvent(piece, None)
        if self.fail:
            raise RuntimeError("the scripted generation broke")
        yield FinalEvent("", self.finish, 3, len(self.pieces))


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Script:
    scripted = Script()
    replace_generation(monkeypatch, scripted)
    return scripted


def events_of(text: str) -> list[dict[str, Any]]:
    """The data of each server-sent event; its name must be its type."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output
    ]


THINK_AND_CALL = (
    "<think>\nLet me think.\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.anyio
async def test_reasoning_text_and_a_call_streamed_and_whole(
    serve: Any, script: Script
) -> None:
    script.pieces = [
        THINK_AND_CALL[i : i + 3] for i in range(0, len(THINK_AND_CALL), 3)
    ]
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER]}
    async with serve() as served:
        whole = (await served.client.post("/v1/responses", json=body)).json()
        streamed = await served.client.post(
            "/v1/responses", json={**body, "stream": True}
        )
    assert [item["type"] for item in whole["output"]] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert whole["output"][0]["content"][0]["text"] == "Let me think."
    assert whole["output"][1]["content"][0]["text"].strip() == "Checking."
    assert json.loads(whole["output"][2]["arguments"]) == {"city": "Paris"}
    events = events_of(streamed.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "response.completed"
    assert without_ids(last["response"]["output"]) == without_ids(whole["output"])
    kinds = {e["type"] for e in events}
    assert {
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    } <= kinds
    reasoning = "".join(
        e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"
    )
    assert reasoning == "Let me think."
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == last["response"]["output"]


@pytest.mark.anyio
@pytest.mark.parametrize(("effort", "thinking"), [("none", False), ("high", True)])
async def test_reasoning_effort_switches_thinking(
    serve: Any, script: Script, effort: str, thinking: bool
) -> None:
    script.pieces = ["ok"]
    body = {"model": MODEL, "input": "hi", "reasoning": {"effort": effort}}
    async with serve() as served:
        answer = await served.client.post("/v1/responses", json=body)
    assert answer.status_code == 200
    assert script.params[0].template_kwargs == (("enable_thinking", thinking),)


@pytest.mark.anyio
async def test_a_failure_after_the_stream_began_is_response_failed(
    serve: Any, script: Script
) -> None:
    script.pieces = ["some", " text"]
    script.fail = True
    body = {"model": MODEL, "input": "hi", "stream": True}
    async with serve() as served:
        answer = await served.client.post("/v1/responses", json=body)
    assert answer.status_code == 200
    events = events_of(answer.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "some text"


@pytest.mark.anyio
async def test_a_prompt_too_long_names_input(serve: Any) -> None:
    async with serve(max_prompt_tokens=8) as served:
        body = {"model": MODEL, "input": "word " * 400, "max_output_tokens": 4}
        answer = await served.client.post("/v1/responses", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("input", "context_length_exceeded")


CUT_CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'


def collapsed(events: list[dict[str, Any]]) -> list[str]:
    """The events' types, each run of one delta type as one."""
    kinds: list[str] = []
    for event in events:
        kind = event["type"]
        if not (kind.endswith(".delta") and kinds and kinds[-1] == kind):
            kinds.append(kind)
    return kinds


@pytest.mark.anyio
async def test_the_item_a_length_cut_ends_is_incomplete(
    serve: Any, script: Script
) -> None:
    """A call cut by the output's length is ``incomplete``, in the response
    and in its ``output_item.done``: no client takes its partial arguments
    for whole ones. The items before it ended and are ``completed``."""
    script.pieces = [CUT_CALL[i : i + 3] for i in range(0, len(CUT_CALL), 3)]
    script.finish = "length"
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER]}
    async with serve() as served:
        whole = (await served.client.post("/v1/responses", json=body)).json()
        streamed = await served.client.post(
            "/v1/responses", json={**body, "stream": True}
        )
        replay = await served.client.get(
            f"/v1/responses/{whole['id']}", params={"stream": "true"}
        )
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    statuses = [(item["type"], item["status"]) for item in whole["output"]]
    assert statuses == [("message", "completed"), ("function_call", "incomplete")]
    for events in (events_of(streamed.text), events_of(replay.text)):
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [item["status"] for item in done] == ["completed", "incomplete"]
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["output"] == done


@pytest.mark.anyio
async def test_a_stored_response_is_replayed_as_its_stream(
    serve: Any, script: Script
) -> None:
    """``GET /v1/responses/{id}?stream=true``: the events its ``POST``
    streamed, each text in one delta, the last one the stored response;
    ``starting_after`` skips the events up to that sequence number."""
    script.pieces = [
        THINK_AND_CALL[i : i + 3] for i in range(0, len(THINK_AND_CALL), 3)
    ]
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "stream": True}
    async with serve() as served:
        streamed = events_of(
            (await served.client.post("/v1/responses", json=body)).text
        )
        response_id = streamed[0]["response"]["id"]
        url = f"/v1/responses/{response_id}"
        stored = (await served.client.get(url)).json()
        replay = events_of((await served.client.get(f"{url}?stream=true")).text)
        later = await served.client.get(f"{url}?stream=true&starting_after=4")
        sdk_events = [
            event
            async for event in await served.sdk().responses.retrieve(
                response_id, stream=True
            )
        ]
        refused = await served.client.get(f"{url}?stream=maybe")
    assert collapsed(replay) == collapsed(streamed)
    assert [e["sequence_number"] for e in replay] == list(range(len(replay)))
    assert replay[-1] == {**streamed[-1], "sequence_number": len(replay) - 1}
    assert replay[-1]["response"] == stored
    assert replay[0]["response"] == streamed[0]["response"]
    done = [e for e in replay if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == stored["output"]
    assert events_of(later.text) == replay[5:]
    assert sdk_events[-1].type == "response.completed"
    assert sdk_events[-1].response.id == response_id
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream"


@pytest.mark.anyio
async def test_input_items_are_listed_as_openais_items(
    serve: Any, script: Script
) -> None:
    """Each input item with its id and status, and an answer's text sent
    back as input with its annotations (checked against OpenAI's document
    by the test client, as every answer is)."""
    script.pieces = ["ok"]
    cited = {
        "type": "url_citation",
        "url": "https://example.com/",
        "title": "Example",
        "start_index": 0,
        "end_index": 4,
    }
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "Sure", "annotations": [cited]}
            ],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]
    body = {"model": MODEL, "input": items, "tools": [WEATHER]}
    async with serve() as served:
        created = (await served.client.post("/v1/responses", json=body)).json()
        listed = await served.client.get(
            f"/v1/responses/{created['id']}/input_items", params={"order": "asc"}
        )
    assert listed.status_code == 200, listed.text
    data = listed.json()["data"]
    assert [(item["type"], item["status"]) for item in data] == [
        ("message", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call_output", "completed"),
    ]
    assert all(item["id"] for item in data)
    assert data[0]["content"] == [{"type": "input_text", "text": "Weather in Paris?"}]
    assert data[1]["content"][0]["annotations"] == [cited]


@pytest.mark.anyio
async def test_usage_and_the_echoed_fields_are_openais(
    serve: Any, script: Script
) -> None:
    """``usage`` has ``cache_write_tokens`` (0: the prompt cache keeps
    prefixes on its own); ``user`` is echoed when given, and left out, not
    null, when not; a function tool is echoed with ``strict`` and
    ``parameters``."""
    script.pieces = ["ok"]
    bare = {"type": "function", "name": "ping"}
    body = {"model": MODEL, "input": "hi", "tools": [bare]}
    async with serve() as served:
        plain = (await served.client.post("/v1/responses", json=body)).json()
        named = await served.client.post("/v1/responses", json={**body, "user": "u1"})
    details = plain["usage"]["input_tokens_details"]
    assert details == {
        "cached_tokens": details["cached_tokens"],
        "cache_write_tokens": 0,
    }
    assert "user" not in plain
    assert named.json()["user"] == "u1"
    assert plain["tools"] == [
        {**bare, "description": None, "parameters": None, "strict": None}
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("context_management", [{"type": "compaction"}], "context_management"),
        ("moderation", {"model": "omni-moderation-latest"}, "moderation"),
        ("prompt_cache_options", {"mode": "explicit"}, "prompt_cache_options.mode"),
    ],
)
async def test_a_field_this_server_cannot_honour_is_a_400_that_names_it(
    serve: Any, field: str, value: Any, param: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, field: value}
    async with serve() as served:
        answer = await served.client.post("/v1/responses", json=body)
        unset = await served.client.post("/v1/responses", json={**body, field: None})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert "Unrecognized" not in error["message"]
    assert unset.status_code == 200, unset.text


@pytest.mark.anyio
async def test_the_prompt_cache_options_it_has_are_taken_and_echoed(
    serve: Any, script: Script
) -> None:
    """``implicit`` (by prefix, on its own) is this server's one mode, and
    ``30m`` the document's one ``ttl`` (its default)."""
    script.pieces = ["ok"]
    options = {"ttl": "30m", "mode": "implicit"}
    body = {"model": MODEL, "input": "hi", "prompt_cache_options": options}
    async with serve() as served:
        answer = await served.client.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_cache_options"] == options
