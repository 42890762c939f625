"""The Anthropic Messages door end to end: ``serve`` in a subprocess on a
free loopback port, driven by the official ``anthropic`` package, raw
HTTP for the event sequence and hostile bodies, and Claude Code itself
(``claude -p``, installed by ``.ci/run`` from npm at a pinned version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mlx_pinned import MLXThreadBusyError
from mlx_pinned.server.failures import (
    ModelNotLoadedError,
    OverloadedError,
    PromptTooLongError,
)
from mlx_pinned.server.http.anthropic_messages import MessagesEndpoint
from mlx_pinned.server.http.anthropic_messages.output import (
    ANTHROPIC_ERRORS,
)
from mlx_pinned.server.http.errors import APIError, timed_out
from mlx_pinned.server.http.routes import APIKeyMiddleware, ErrorEdge
from mlx_pinned.testing import image_data_uri, tiny_vlm_path

from .kit import CLAUDE, ending_model, running

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
# The same weights, whose every ordinary token ends the turn: an answer
# ends at once by itself (the random weights never pick an end-of-turn
# token), so Claude Code's turn ends as a real one does.
ENDING = "tiny-ending"
#: Where .ci/run installs Claude Code (npm --prefix .venv/npm).
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    opened: list[anthropic.Anthropic | openai.OpenAI] = field(default_factory=list)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0)
        self.opened.append(client)
        return client

    def async_client(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="x", max_retries=0)

    def openai_client(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)
        self.opened.append(client)
        return client

    def post(self, path: str, body: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("anthropic")
    ending = ending_model(folder / "ending")
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += [str(tiny_vlm_path()), str(ending)]
    command += ["--served-model-name", MODEL, "--served-model-name", ENDING]
    command += ["--port", "0"]
    with running(command, folder / "server.log") as started:
        served = Server(started.process, started.url, started.log)
        yield served
        for client in served.opened:
            client.close()


def user(text: str = "Describe the weather.") -> Any:
    return [{"role": "user", "content": text}]


def texts(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


GREEDY: dict[str, Any] = {"temperature": 0.0}


@pytest.mark.slow
class TestSDK:
    def test_create(self, server: Server) -> None:
        message = server.client().messages.create(
            model=MODEL,
            max_tokens=12,
            messages=user(),
            system="Be terse.",
            extra_body=GREEDY,
        )
        assert message.type == "message"
        assert message.role == "assistant"
        assert message.id.startswith("msg_")
        assert message.model == MODEL
        assert message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == 12
        assert message.usage.input_tokens > 5
        assert [b.type for b in message.content] == ["text"]
        assert texts(message)

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_async_create_equals_sync(self, server: Server) -> None:
        kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 10}
        kwargs |= {"messages": user(), "extra_body": GREEDY}
        async with server.async_client() as client:
            whole = await client.messages.create(**kwargs)
        assert texts(whole) == texts(server.client().messages.create(**kwargs))

    def test_stream_equals_whole(self, server: Server) -> None:
        client = server.client()
        kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 16}
        kwargs |= {"messages": user(), "extra_body": GREEDY}
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            pieces = list(stream.text_stream)
            streamed = stream.get_final_message()
        assert "".join(pieces) == texts(whole) == texts(streamed)
        assert streamed.stop_reason == whole.stop_reason == "max_tokens"
        assert streamed.usage.output_tokens == whole.usage.output_tokens == 16
        assert streamed.usage.input_tokens == whole.usage.input_tokens

    def test_count_tokens_equals_the_prompt(self, server: Server) -> None:
        client = server.client()
        system = [
            {
                "type": "text",
                "text": "Be terse.",
                "cache_control": {"type": "ephemeral"},
            }
        ]
        count = client.messages.count_tokens(
            model=MODEL,
            messages=user(),
            system=system,
        )
        message = client.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=user(),
            system=system,
        )
        assert count.input_tokens == message.usage.input_tokens > 5

    def test_an_image_reaches_the_prompt(self, server: Server) -> None:
        client = server.client()
        data = image_data_uri(64, 64).split(",", 1)[1]
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": data},
        }
        content = [image, {"type": "text", "text": "What is it?"}]
        message = client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": content}],
        )
        plain = client.messages.create(
            model=MODEL, max_tokens=4, messages=user("What is it?")
        )
        # 4 image tokens and their start and end markers.
        assert message.usage.input_tokens == plain.usage.input_tokens + 6
        count = client.messages.count_tokens(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
        )
        assert count.input_tokens == message.usage.input_tokens

    def test_system_inside_messages_joins_the_system_prompt(
        self, server: Server
    ) -> None:
        client = server.client()
        inside = [
            {"role": "system", "content": [{"type": "text", "text": "Two."}]},
            *user(),
        ]
        both = client.messages.create(
            model=MODEL,
            max_tokens=8,
            system="One.",
            messages=inside,
            extra_body=GREEDY,
        )
        joined = client.messages.create(
            model=MODEL,
            max_tokens=8,
            system="One.\n\nTwo.",
            messages=user(),
            extra_body=GREEDY,
        )
        assert texts(both) == texts(joined)
        assert both.usage.input_tokens == joined.usage.input_tokens

    def test_the_same_text_as_chat_completions(self, server: Server) -> None:
        message = server.client().messages.create(
            model=MODEL,
            max_tokens=16,
            system="Be terse.",
            messages=user(),
            extra_body=GREEDY,
        )
        chat = server.openai_client().chat.completions.create(
            model=MODEL,
            max_tokens=16,
            temperature=0.0,
            messages=[
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": user()[0]["content"]},
            ],
        )
        assert chat.choices[0].message.content == texts(message)
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == message.usage.input_tokens

    def test_a_forced_tool_call_and_its_result(self, server: Server) -> None:
        client = server.client()
        message = client.messages.create(
            model=MODEL,
            max_tokens=200,
            messages=user("Weather in Paris?"),
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        assert message.stop_reason == "tool_use"
        (call,) = [b for b in message.content if b.type == "tool_use"]
        assert call.name == "get_weather"
        assert call.id.startswith("toolu_")
        assert isinstance(call.input, dict)
        assert call.input["city"] in ("Paris", "Rome")
        history = [
            *user("Weather in Paris?"),
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": [{"type": "text", "text": "Sunny, 21 C."}],
                    }
                ],
            },
        ]
        answer = client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=history,
            tools=[WEATHER],
        )
        assert answer.usage.input_tokens > message.usage.input_tokens

    def test_a_streamed_tool_call_reassembles_to_the_whole(
        self, server: Server
    ) -> None:
        client = server.client()
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 200,
            "messages": user("Weather?"),
            "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "extra_body": GREEDY,
        }
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            partial = "".join(
                event.partial_json for event in stream if event.type == "input_json"
            )
            streamed = stream.get_final_message()
        (call,) = [b for b in whole.content if b.type == "tool_use"]
        (same,) = [b for b in streamed.content if b.type == "tool_use"]
        assert json.loads(partial) == call.input == same.input
        assert streamed.stop_reason == whole.stop_reason == "tool_use"

    def test_thinking_comes_as_thinking_blocks(self, server: Server) -> None:
        client = server.client()
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 1100,
            "messages": user(),
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "extra_body": GREEDY,
        }
        whole = client.messages.create(**kwargs)
        # The tiny model never closes its thinking: its budget closes it.
        assert [b.type for b in whole.content] == ["thinking", "text"]
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[0].thinking == whole.content[0].thinking
        assert whole.content[0].thinking


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in response.text.strip().split("\n\n"):
        kind, data = chunk.split("\n", 1)
        out.append(
            (kind.removeprefix("event: "), json.loads(data.removeprefix("data: ")))
        )
    return out


class TestWire:
    def test_the_event_sequence(self, server: Server) -> None:
        body = {"model": MODEL, "max_tokens": 5, "messages": user(), "stream": True}
        response = server.post("/v1/messages?beta=true", body)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        seen = events(response)
        kinds = [kind for kind, _ in seen]
        assert kinds[:3] == ["message_start", "ping", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(kinds[3:-3]) == {"content_block_delta"}
        assert all(kind == data["type"] for kind, data in seen)
        delta = seen[-2][1]
        assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == 5
        assert delta["usage"]["input_tokens"] > 5

    def test_claude_codes_fields_are_accepted(self, server: Server) -> None:
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "hi",
                            "cache_control": {"type": "ephemeral"},
                        }
                    ],
                }
            ],
            "system": [
                {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
            ],
            "metadata": {"user_id": "someone"},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {
                "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]
            },
            "output_config": {"effort": "high"},
            "tools": [{**WEATHER, "defer_loading": True}, {**WEATHER, "name": "other"}],
        }
        response = server.post("/v1/messages?beta=true", body)
        assert response.status_code == 200, response.text


HOSTILE: list[tuple[str, Any, str]] = [
    ("not json", b"{", ""),
    ("no max_tokens", {"model": MODEL, "messages": user()}, "max_tokens"),
    (
        "a wrong type",
        {"model": MODEL, "max_tokens": "5", "messages": user()},
        "max_tokens",
    ),
    (
        "an unknown field",
        {"model": MODEL, "max_tokens": 5, "messages": user(), "bogus": 1},
        "bogus",
    ),
    (
        "an unknown role",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "tool", "content": "x"}],
        },
        "messages",
    ),
    (
        "an unknown block",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "document"}]}],
        },
        "messages",
    ),
    (
        "deep nesting",
        b'{"model": "tiny", "max_tokens": 5, "messages": '
        + b"[" * 20000
        + b"]" * 20000
        + b"}",
        "",
    ),
    (
        "a huge array",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": user(),
            "stop_sequences": ["a"] * 100_000,
        },
        "stop_sequences",
    ),
    (
        "a bad image",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": "bm90IGFuIGltYWdl",
                            },
                        }
                    ],
                }
            ],
        },
        "messages[0].content[0].source",
    ),
    (
        "a server tool",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": user(),
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        "tools",
    ),
    (
        "an effort",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": user(),
            "output_config": {"effort": "low"},
        },
        "effort",
    ),
    (
        "a context edit",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": user(),
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        },
        "clear_tool_uses",
    ),
    (
        "a budget over max_tokens",
        {
            "model": MODEL,
            "max_tokens": 1100,
            "messages": user(),
            "thinking": {"type": "enabled", "budget_tokens": 2000},
        },
        "budget_tokens",
    ),
    (
        "a tool choice without tools",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": user(),
            "tool_choice": {"type": "any"},
        },
        "tool_choice",
    ),
    (
        "an empty content list",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": []}],
        },
        "messages[0].content",
    ),
    (
        "no turn with content",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "system", "content": ""}],
        },
        "messages",
    ),
    (
        "no tokens",
        {"model": MODEL, "max_tokens": 0, "messages": user()},
        "max_tokens",
    ),
]


@pytest.mark.parametrize(
    ("body", "named"), [(b, n) for _, b, n in HOSTILE], ids=[i for i, _, _ in HOSTILE]
)
def test_hostile_bodies_get_anthropics_400(
    server: Server, body: Any, named: str
) -> None:
    assert_400(server.post("/v1/messages", body), named)


def assert_400(response: httpx.Response, named: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


@pytest.mark.parametrize(
    ("body", "named"),
    [(b, n) for _, b, n in HOSTILE if n not in ("max_tokens", "budget_tokens")],
)
def test_hostile_counts_get_anthropics_400(
    server: Server, body: Any, named: str
) -> None:
    if isinstance(body, dict):
        body = {
            k: v for k, v in body.items() if k not in ("max_tokens", "stop_sequences")
        }
        if named == "stop_sequences":
            body["stop_sequences"] = []
    assert_400(server.post("/v1/messages/count_tokens", body), named)


def test_an_unknown_model_is_anthropics_404(server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        server.client().messages.create(model="nope", max_tokens=5, messages=user())
    assert caught.value.body["error"]["type"] == "not_found_error"


@pytest.mark.slow
def test_claude_code_runs_against_the_server(server: Server, tmp_path: Path) -> None:
    assert CLAUDE.exists(), f"install Claude Code as .ci/run does: {CLAUDE}"
    before = server.log_text().count("\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": "x",
    }
    done = subprocess.run(
        [str(CLAUDE), "-p", "hi", "--model", ENDING, "--bare", "--tools", "Read"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = server.log_text().splitlines()[before:]
    posts = [line for line in lines if "POST /v1/messages" in line]
    assert posts, lines
    assert all(" 200 " in line for line in posts), posts


def test_a_stop_sequence_is_named(server: Server) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"model": MODEL, "messages": user()}
    kwargs["extra_body"] = GREEDY
    free = texts(client.messages.create(max_tokens=16, **kwargs))
    stop = free[4:6]
    message = client.messages.create(max_tokens=16, stop_sequences=[stop], **kwargs)
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert texts(message) == free[: free.find(stop)]
    with client.messages.stream(
        max_tokens=16, stop_sequences=["\x00never", stop], **kwargs
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence"
    assert streamed.stop_sequence == stop
    assert texts(streamed) == texts(message)


def test_x_api_key_passes_the_api_key_check() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await PlainTextResponse("ok")(scope, receive, send)

    # No lifespan (no "with"): only the middleware is under test.
    routes = [Route("/v1/messages", MessagesEndpoint, methods=["POST"])]
    edge = ErrorEdge(routes, retry_after=1)
    client = TestClient(APIKeyMiddleware(app, api_key="secret", errors=edge))
    assert client.post("/v1/messages", headers={"x-api-key": "secret"}).text == "ok"
    bearer = {"authorization": "Bearer secret"}
    assert client.post("/v1/messages", headers=bearer).text == "ok"
    wrong = client.post("/v1/messages", headers={"x-api-key": "other"})
    assert wrong.status_code == 401
    assert wrong.json()["type"] == "error"
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in wrong.json()["error"]["message"]


def test_an_image_in_a_tool_result_reaches_the_prompt(server: Server) -> None:
    def count(result: Any) -> int:
        messages = [
            *user("Look."),
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": result}
                ],
            },
        ]
        tool = {"name": "look", "input_schema": {"type": "object"}}
        body = {"model": MODEL, "messages": messages, "tools": [tool]}
        response = server.post("/v1/messages/count_tokens", body)
        assert response.status_code == 200, response.text
        tokens: int = response.json()["input_tokens"]
        return tokens

    data = image_data_uri(64, 64).split(",", 1)[1]
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": data},
    }
    text = {"type": "text", "text": "A picture."}
    assert count([text, image]) == count([text]) + 6
    assert count("A picture.") == count([text])


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (OverloadedError(3, retry_after=2), 529, "overloaded_error"),
        (MLXThreadBusyError("busy"), 529, "overloaded_error"),
        (ModelNotLoadedError("tiny", retry_after=2), 503, "api_error"),
        (PromptTooLongError("too long", 10, 5), 400, "invalid_request_error"),
        (timed_out(5.0), 504, "timeout_error"),
        (APIError(413, "too large"), 413, "request_too_large"),
    ],
)
def test_the_error_table(exc: Exception, status: int, kind: str) -> None:
    error = ANTHROPIC_ERRORS.answer(exc, retry_after=1)
    assert error is not None
    assert error.status == status
    body = json.loads(ANTHROPIC_ERRORS.body(error))
    assert body == {"type": "error", "error": {"type": kind, "message": error.message}}
    event = ANTHROPIC_ERRORS.event(error)
    assert event.startswith(b"event: error\ndata: ")
    assert json.loads(event.split(b"data: ", 1)[1]) == body
    if status in (529, 503):
        assert "Retry-After" in error.headers


def test_a_bug_is_no_known_error() -> None:
    assert ANTHROPIC_ERRORS.answer(KeyError("x"), retry_after=1) is None


def test_metrics_count_the_messages_routes(server: Server) -> None:
    client = server.client()
    client.messages.count_tokens(model=MODEL, messages=user())
    client.messages.create(model=MODEL, max_tokens=1, messages=user())
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        assert f'route="{route}",status="200"' in text
