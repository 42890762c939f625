"""Ollama's API: the official ``ollama`` Python client (PyPI, pinned in the
test extra) in process, each field of ``/api/chat``, ``/api/generate`` and
``/api/embed`` against a reference that fails if the field is ignored (the
same request to ``/v1/chat/completions`` or ``/v1/embeddings``), hostile
bodies, and the ``ollama`` npm client against ``serve`` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import ollama
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.server.events import FinalEvent, GenerationParams, TokenEvent
from mlx_pinned.server.http.ollama.protocol import keep_alive_seconds
from mlx_pinned.testing import image_data_uri, tiny_embedding_path, tiny_vlm_path

from .conftest import drive, replace_generation
from .kit import TOL, Lifespan, Served, in_process, running, running_server

pytestmark = pytest.mark.anyio

IMAGE = image_data_uri(64, 64).split(",", 1)[1]
USER = [{"role": "user", "content": "Describe this.", "images": [IMAGE]}]
# The same turn as chat completions writes it (Ollama puts images first).
OPENAI_USER = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_data_uri(64, 64)}},
            {"type": "text", "text": "Describe this."},
        ],
    }
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
#: The npm client's version, installed by .ci/run beside Codex.
OLLAMA_NPM = "0.6.4"


class Ollama(Served):
    def ollama(self) -> ollama.AsyncClient:
        transport = httpx.ASGITransport(app=self.app)
        return ollama.AsyncClient(host="http://test", transport=transport)

    async def api(self, path: str, body: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.client.post(path, content=content)


@pytest.fixture
def serve(lifespan: Lifespan) -> Any:
    @asynccontextmanager
    async def serve(**options: Any) -> AsyncIterator[Ollama]:
        options.setdefault("max_num_seqs", 4)
        app = create_app(
            [str(tiny_vlm_path()), str(tiny_embedding_path())],
            served_model_name=("tiny", "emb"),
            model_settings=({}, {"model_kind": "embedding"}),
            **options,
        )
        async with in_process(app, lifespan, Ollama) as served:
            yield served

    return serve


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(item) for item in response.text.splitlines()]


def ollama_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert isinstance(body["error"], str)
    assert body["error"]
    message: str = body["error"]
    return message


class TestPythonClient:
    async def test_list_show_and_ps(self, serve: Any) -> None:
        async with serve() as served:
            client = served.ollama()
            listed = await client.list()
            shown = await client.show("tiny")
            shown_emb = await client.show("emb:latest")
            running = await client.ps()
            engine = served.engine
        names = [model.model for model in listed.models]
        assert names == ["tiny:latest", "emb:latest"]
        assert listed.models[0].size == engine.weight_bytes
        assert listed.models[0].details.family == "qwen3_vl"
        assert shown.capabilities == ["completion", "vision", "tools", "thinking"]
        assert shown.template == engine.facts.chat_template
        assert shown.modelinfo["qwen3_vl.context_length"] == engine.facts.context_length
        assert shown_emb.capabilities == ["embedding"]
        assert [model.model for model in running.models] == names
        assert running.models[0].size_vram == engine.weight_bytes
        # Loaded at start-up, never unloaded by itself: Ollama's "forever".
        assert running.models[0].expires_at.year > 2200

    async def test_chat_whole_and_streamed_with_an_image(self, serve: Any) -> None:
        options = {"temperature": 0, "num_predict": 8}
        async with serve() as served:
            client = served.ollama()
            whole = await client.chat("tiny", messages=USER, options=options)
            parts = [
                part
                async for part in await client.chat(
                    "tiny", messages=USER, options=options, stream=True
                )
            ]
            text_only = await client.chat(
                "tiny", messages=[{"role": "user", "content": "Describe this."}]
            )
        streamed = "".join(part.message.content or "" for part in parts)
        assert streamed == whole.message.content
        assert whole.message.content
        last = parts[-1]
        assert last.done
        assert not any(part.done for part in parts[:-1])
        for answer in (whole, last):
            assert answer.done_reason == "length"
            assert answer.eval_count == 8
            assert answer.prompt_eval_count == whole.prompt_eval_count
            for name in ("prompt_eval_duration", "eval_duration", "load_duration"):
                assert isinstance(getattr(answer, name), int)
            assert answer.total_duration > answer.eval_duration > 0
        # The image's tokens reach the prompt.
        assert whole.prompt_eval_count > text_only.prompt_eval_count

    async def test_generate_and_embed(self, serve: Any) -> None:
        async with serve() as served:
            client = served.ollama()
            generated = await client.generate(
                "tiny", "Describe this.", options={"temperature": 0, "num_predict": 6}
            )
            chatted = await client.chat(
                "tiny",
                messages=[{"role": "user", "content": "Describe this."}],
                options={"temperature": 0, "num_predict": 6},
            )
            embedded = await client.embed("emb", input=["Hello!", "World"])
            reference = await served.client.post(
                "/v1/embeddings", json={"model": "emb", "input": ["Hello!", "World"]}
            )
            legacy = await client.embeddings("emb", prompt="Hello!")
        assert generated.response == chatted.message.content
        assert generated.eval_count == 6
        expected = [item["embedding"] for item in reference.json()["data"]]
        assert len(embedded.embeddings) == 2
        for got, want in zip(embedded.embeddings, expected, strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL
        assert embedded.prompt_eval_count == reference.json()["usage"]["prompt_tokens"]
        assert list(legacy.embedding) == list(embedded.embeddings[0])

    async def test_format_with_a_schema(self, serve: Any) -> None:
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
        async with serve() as served:
            client = served.ollama()
            asked = {"messages": USER, "options": {"temperature": 0, "num_predict": 40}}
            shaped = await client.chat("tiny", format=schema, **asked)
            as_json = await client.chat("tiny", format="json", **asked)
            free = await client.chat("tiny", **asked)
        assert json.loads(shaped.message.content)["city"] in ("Paris", "Rome")
        assert isinstance(json.loads(as_json.message.content), dict)
        with pytest.raises(json.JSONDecodeError):  # not JSON without the format
            json.loads(free.message.content)

    async def test_think(self, serve: Any) -> None:
        asked = {"messages": USER, "options": {"temperature": 0, "num_predict": 8}}
        async with serve() as served:
            client = served.ollama()
            thinking = await client.chat("tiny", think=True, **asked)
            level = await client.chat("tiny", think="low", **asked)
            plain = await client.chat("tiny", think=False, **asked)
            streamed = [
                part
                async for part in await client.chat(
                    "tiny", think=True, stream=True, **asked
                )
            ]
        # The template opens the reasoning: every token is thinking.
        assert thinking.message.thinking
        assert not thinking.message.content
        assert level.message.thinking == thinking.message.thinking
        assert plain.message.content
        assert plain.message.thinking is None
        joined = "".join(part.message.thinking or "" for part in streamed)
        assert joined == thinking.message.thinking

    async def test_tools(self, serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        asked = {"messages": USER, "options": {"num_predict": 4}}
        called = [
            *USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
                ],
            },
            {"role": "tool", "content": "Sunny.", "tool_name": "get_weather"},
        ]
        async with serve() as served:
            client = served.ollama()
            with_tools = await client.chat("tiny", tools=[WEATHER], **asked)
            without = await client.chat("tiny", **asked)
            after = await client.chat(
                "tiny", tools=[WEATHER], messages=called, options={"num_predict": 4}
            )
            # The model's call, scripted: the random weights write none.
            call = (
                '<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>'
            )

            def scripted(
                loaded: Any, params: GenerationParams, images: Any
            ) -> Iterator[TokenEvent | FinalEvent]:
                yield TokenEvent(call[:20])
                yield TokenEvent(call[20:])
                yield FinalEvent("", "stop", 3, 2)

            replace_generation(monkeypatch, scripted)
            whole = await client.chat("tiny", tools=[WEATHER], **asked)
            parts = [
                part
                async for part in await client.chat(
                    "tiny", tools=[WEATHER], stream=True, **asked
                )
            ]
        assert with_tools.prompt_eval_count > without.prompt_eval_count
        assert after.prompt_eval_count > with_tools.prompt_eval_count
        (tool_call,) = whole.message.tool_calls
        assert tool_call.function.name == "get_weather"
        assert tool_call.function.arguments == {"city": "Paris"}
        assert whole.message.content == ""
        streamed = [c for part in parts for c in part.message.tool_calls or []]
        assert streamed == whole.message.tool_calls


# Each case: Ollama's options, the same in chat completions' fields, and a
# variant of those fields that answers otherwise (so the option is not
# ignored: Ollama's answer equals the first and not the second).
SEEDED = {"temperature": 1.0, "seed": 7}
CASES = {
    "temperature": ({"temperature": 0}, {"temperature": 0}, SEEDED),
    "seed": (SEEDED, SEEDED, {"temperature": 1.0, "seed": 8}),
    "top_k": ({**SEEDED, "top_k": 1}, {**SEEDED, "top_k": 1}, SEEDED),
    "top_p": ({**SEEDED, "top_p": 0.05}, {**SEEDED, "top_p": 0.05}, SEEDED),
    "min_p": ({**SEEDED, "min_p": 0.6}, {**SEEDED, "min_p": 0.6}, SEEDED),
    "repeat_penalty": (
        {"temperature": 0, "repeat_penalty": 3.0},
        {"temperature": 0, "repetition_penalty": 3.0},
        {"temperature": 0},
    ),
    "presence_penalty": (
        {"temperature": 0, "presence_penalty": 2.0},
        {"temperature": 0, "presence_penalty": 2.0},
        {"temperature": 0},
    ),
    "frequency_penalty": (
        {"temperature": 0, "frequency_penalty": 2.0},
        {"temperature": 0, "frequency_penalty": 2.0},
        {"temperature": 0},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_chat_equals_chat_completions_token_for_token(
    serve: Any, case: str
) -> None:
    options, fields, otherwise = CASES[case]
    async with serve() as served:
        answer = await served.api(
            "/api/chat",
            {
                "model": "tiny",
                "messages": USER,
                "stream": False,
                "options": {**options, "num_predict": 12},
                "logprobs": True,
                "top_logprobs": 3,
            },
        )
        references = [
            await served.chat(
                {
                    "model": "tiny",
                    "messages": OPENAI_USER,
                    "max_tokens": 12,
                    "logprobs": True,
                    "top_logprobs": 3,
                    **asked,
                }
            )
            for asked in (fields, otherwise)
        ]
    got = answer.json()
    same, other = (reference.json()["choices"][0] for reference in references)
    assert got["message"]["content"] == same["message"]["content"]
    assert got["message"]["content"] != other["message"]["content"]
    entries = same["logprobs"]["content"]
    assert [entry["token"] for entry in got["logprobs"]] == [
        e["token"] for e in entries
    ]
    for mine, theirs in zip(got["logprobs"], entries, strict=True):
        assert abs(mine["logprob"] - theirs["logprob"]) <= TOL
        tops = [(top["token"], top["logprob"]) for top in mine["top_logprobs"]]
        expected = [(top["token"], top["logprob"]) for top in theirs["top_logprobs"]]
        assert [t for t, _ in tops] == [t for t, _ in expected]
        pairs = zip(tops, expected, strict=True)
        assert max(abs(a - b) for (_, a), (_, b) in pairs) <= TOL
    assert got["prompt_eval_count"] == references[0].json()["usage"]["prompt_tokens"]


async def test_num_predict_stop_and_num_ctx(serve: Any) -> None:
    body = {"model": "tiny", "messages": USER, "stream": False}
    greedy = {"temperature": 0, "num_predict": 12}
    async with serve() as served:
        full = (await served.api("/api/chat", {**body, "options": greedy})).json()
        text = full["message"]["content"]
        stop = text[len(text) // 2 :][:2]
        stopped = await served.api(
            "/api/chat", {**body, "options": {**greedy, "stop": [stop]}}
        )
        short = await served.api(
            "/api/chat", {**body, "options": {**greedy, "num_predict": 3}}
        )
        capped = await served.api("/api/chat", {**body, "options": {"num_ctx": 8}})
        huge = await served.api("/api/chat", {**body, "options": {"num_ctx": 10**9}})
    assert stopped.json()["message"]["content"] == text[: text.index(stop)]
    assert stopped.json()["done_reason"] == "stop"
    assert short.json()["eval_count"] == 3
    assert "limit is 8 prompt tokens" in ollama_error(capped, 400)
    assert "options.num_ctx" in ollama_error(huge, 400)


async def test_generate_fields(serve: Any) -> None:
    options = {"temperature": 0, "num_predict": 4}
    body = {"model": "tiny", "prompt": "Hello", "stream": False, "options": options}
    async with serve() as served:
        template = served.engine.facts.chat_template

        async def generate(**fields: Any) -> httpx.Response:
            return await served.api("/api/generate", {**body, **fields})

        plain = (await generate()).json()
        system = (await generate(system="Be terse.")).json()
        raw = (await generate(raw=True)).json()
        imaged = (await generate(images=[IMAGE])).json()
        own = await generate(template=template)
        other = await generate(template="{{ .Prompt }}")
        suffix = await generate(suffix="The end.")
    assert system["prompt_eval_count"] > plain["prompt_eval_count"]
    # Raw: the prompt as it is, without the chat template's turns.
    assert raw["prompt_eval_count"] < plain["prompt_eval_count"]
    assert imaged["prompt_eval_count"] > plain["prompt_eval_count"]
    assert own.json()["response"] == plain["response"]
    assert "template" in ollama_error(other, 400)
    assert "suffix" in ollama_error(suffix, 400)


async def test_embed_fields(serve: Any) -> None:
    async with serve() as served:
        cut = await served.api(
            "/api/embed", {"model": "emb", "input": "Hello!", "dimensions": 16}
        )
        reference = await served.client.post(
            "/v1/embeddings", json={"model": "emb", "input": "Hello!", "dimensions": 16}
        )
        untrained = await served.api(
            "/api/embed", {"model": "emb", "input": "Hello!", "dimensions": 48}
        )
        long = " ".join(["word"] * 400)
        refused = await served.api(
            "/api/embed", {"model": "emb", "input": long, "truncate": False}
        )
        not_cut = await served.api("/api/embed", {"model": "emb", "input": long})
    (vector,) = cut.json()["embeddings"]
    expected = reference.json()["data"][0]["embedding"]
    assert len(vector) == 16
    assert max(abs(a - b) for a, b in zip(vector, expected, strict=True)) <= TOL
    assert "dimensions" in ollama_error(untrained, 400)
    assert "more than this model's" in ollama_error(refused, 400)
    assert "truncate" in ollama_error(not_cut, 400)


async def test_names_with_the_latest_tag(serve: Any) -> None:
    body = {"messages": USER, "stream": False, "options": {"num_predict": 2}}
    async with serve() as served:
        tagged = await served.api("/api/chat", {"model": "tiny:latest", **body})
        openai_side = await served.chat(
            {"model": "tiny:latest", "messages": OPENAI_USER, "max_tokens": 2}
        )
        unknown = await served.api("/api/chat", {"model": "other:latest", **body})
        embed_wrong = await served.api("/api/embed", {"model": "tiny", "input": "x"})
    assert tagged.status_code == openai_side.status_code == 200
    assert "'other:latest' does not exist" in ollama_error(unknown, 404)
    assert "/v1/chat/completions" in ollama_error(embed_wrong, 400)


async def test_management_routes_say_what_the_server_does_instead(
    serve: Any,
) -> None:
    async with serve() as served:
        client = served.client
        pulled = await served.api("/api/pull", {"model": "tiny", "stream": False})
        unknown = await served.api("/api/pull", {"model": "llama3.2"})
        refused = [
            await served.api("/api/push", {"model": "tiny"}),
            await served.api("/api/create", {"model": "x", "from": "tiny"}),
            await served.api("/api/copy", {"source": "tiny", "destination": "x"}),
            await client.request("DELETE", "/api/delete", json={"model": "tiny"}),
            await served.api("/api/blobs/sha256:00", b"blob"),
        ]
        version = await client.get("/api/version")
        head = await client.head("/")
    assert pulled.json() == {"status": "success"}
    assert "does not exist" in ollama_error(unknown, 404)
    for answer in refused:
        assert "--config" in ollama_error(answer, 403)
    assert "unload" in refused[3].json()["error"]
    assert version.json()["version"].count(".") == 2
    assert head.status_code == 200


HOSTILE = [
    ("/api/chat", b"{not json"),
    ("/api/chat", {"model": "tiny", "messages": "hi"}),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "wizard"}]}),
    ("/api/chat", {"model": 7, "messages": []}),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"num_ctx": 2**40}}),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"mirostat": 1}}),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"wings": 2}}),
    ("/api/chat", {"model": "tiny", "messages": USER, "options": {"top_k": "x"}}),
    ("/api/chat", {"model": "tiny", "messages": USER, "keep_alive": "soon"}),
    ("/api/chat", {"model": "tiny", "messages": USER, "keep_alive": [1]}),
    ("/api/chat", {"model": "tiny", "messages": USER, "think": "hard"}),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": "yaml"}),
    ("/api/chat", {"model": "tiny", "messages": USER, "format": {"type": 7}}),
    ("/api/chat", {"model": "tiny", "messages": USER, "truncate": True}),
    ("/api/chat", {"model": "tiny", "messages": USER, "top_logprobs": 99}),
    ("/api/chat", {"model": "tiny", "messages": USER, "wings": 1}),
    (
        "/api/chat",
        {"model": "tiny", "messages": [{"role": "user", "images": ["@@notbase64@@"]}]},
    ),
    (
        "/api/chat",
        {"model": "tiny", "messages": [{"role": "user", "images": ["aGVsbG8="]}]},
    ),
    ("/api/generate", {"model": "tiny", "prompt": "x", "context": [1, 2]}),
    ("/api/generate", {"model": "tiny", "prompt": "x", "raw": True, "images": [IMAGE]}),
    ("/api/generate", {"model": "tiny", "prompt": "x", "options": {"num_predict": 0}}),
    ("/api/generate", {"model": "tiny", "prompt": "x", "images": "abc"}),
    ("/api/embed", {"model": "emb", "input": [1, 2]}),
    ("/api/embed", {"model": "emb", "input": "x", "options": {"temperature": 1}}),
    ("/api/embed", {"model": "emb", "input": "x", "dimensions": -1}),
    ("/api/embeddings", {"model": "emb", "prompt": ["x"]}),
    ("/api/show", {"model": ["tiny"]}),
    ("/api/show", {"model": "nope"}),
    ("/api/pull", b"[]"),
    ("/api/pull", b"{bad"),
]


async def test_hostile_bodies_get_ollamas_4xx(serve: Any) -> None:
    async with serve() as served:
        for path, body in HOSTILE:
            answer = await served.api(path, body)
            assert 400 <= answer.status_code < 500, (path, body, answer.text)
            ollama_error(answer, answer.status_code)
        fine = await served.api(
            "/api/chat",
            {
                "model": "tiny",
                "messages": USER,
                "stream": False,
                "options": {"num_predict": 2},
            },
        )
    assert fine.status_code == 200


# The ollama client (0.6.3) raises its ResponseError inside its own loop over
# httpx's lines, which leaves that iterator to the collector; trio reports it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_failure_after_the_first_line_is_a_last_error_line(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(
        loaded: Any, params: GenerationParams, images: Any
    ) -> Iterator[TokenEvent | FinalEvent]:
        yield TokenEvent("Hello")
        raise RuntimeError("the model broke")

    replace_generation(monkeypatch, failing)
    async with serve() as served:
        answer = await served.api("/api/chat", {"model": "tiny", "messages": USER})
        with pytest.raises(ollama.ResponseError):
            async for _ in await served.ollama().chat(
                "tiny", messages=USER, stream=True
            ):
                pass
    got = lines(answer)
    assert got[0]["message"]["content"] == "Hello"
    assert set(got[-1]) == {"error"}


async def test_a_client_that_leaves_an_ndjson_stream(serve: Any) -> None:
    body = {"model": "tiny", "messages": USER, "options": {"num_predict": 200}}
    async with serve(stream_write_interval=0) as served:
        with anyio.fail_after(60):
            status, sent = await drive(
                served.app, body, disconnect_after=2, path="/api/chat"
            )
        after = await served.api(
            "/api/chat", {**body, "stream": False, "options": {"num_predict": 2}}
        )
    assert status == 200
    assert not any(b'"done":true' in chunk for chunk in sent)
    assert after.status_code == 200


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        (300, 300.0),
        (0, 0.0),
        ("0", 0.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        (-1, float("inf")),
        ("-1m", float("inf")),
        (None, None),
    ],
)
def test_keep_alive_reads_ollamas_durations(given: Any, seconds: float | None) -> None:
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("given", ["5", "soon", "5 m", "m", True, [1]])
def test_keep_alive_refuses_what_is_no_duration(given: Any) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds(given)


def _node_modules() -> Path:
    cache = Path(os.environ.get("MLX_PINNED_CACHE", Path.home() / ".cache/mlx-pinned"))
    return cache / "npm" / f"ollama-{OLLAMA_NPM}" / "node_modules"


NODE_SCRIPT = """
const { Ollama } = require("ollama");
const client = new Ollama({ host: process.argv[2] });
const image = process.argv[3];
(async () => {
  const out = {};
  out.list = (await client.list()).models.map((m) => m.model);
  out.show = (await client.show({ model: "tiny" })).capabilities;
  out.ps = (await client.ps()).models.map((m) => m.model);
  const messages = [{ role: "user", content: "Describe this.", images: [image] }];
  const options = { temperature: 0, num_predict: 8 };
  let streamed = "";
  let last = null;
  const asked = { model: "tiny", messages, options };
  for await (const part of await client.chat({ ...asked, stream: true })) {
    streamed += part.message.content;
    last = part;
  }
  out.streamed = streamed;
  out.done = [last.done, last.done_reason, last.eval_count];
  out.whole = (await client.chat(asked)).message.content;
  const generated = await client.generate({ model: "tiny", prompt: "Hi", options });
  out.generate = generated.response;
  const embedded = await client.embed({ model: "emb", input: ["a", "b"] });
  out.embed = embedded.embeddings.length;
  out.think = (await client.chat({ ...asked, think: true })).message.thinking;
  console.log(JSON.stringify(out));
})().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.mark.slow
def test_the_readmes_ollama_example_runs_against_the_demo(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (source,) = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", readme, re.DOTALL | re.M)
        if "import ollama" in block
    ]
    with running_server(tmp_path / "server.log") as server:
        source = source.replace("http://127.0.0.1:8000", server.url)
        done = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    listed, answered = done.stdout.splitlines()
    assert "mlx-pinned-demo:latest" in listed
    assert "mlx-pinned-demo-embedding:latest" in listed
    assert answered.endswith(" 16 length")


@pytest.mark.slow
def test_the_npm_client_against_serve(tmp_path: Path) -> None:
    modules = _node_modules()
    node = shutil.which("node")
    if node is None or not (modules / "ollama").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"node and the ollama npm package ({modules}) are needed")
        pytest.skip("node or the ollama npm package is missing (.ci/run installs it)")
    config = tmp_path / "models.toml"
    config.write_text(
        f'[[models]]\npath = "{tiny_vlm_path()}"\nname = "tiny"\n'
        f'[[models]]\npath = "{tiny_embedding_path()}"\nname = "emb"\n'
        'model_kind = "embedding"\n'
    )
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", "--port", "0"]
    command += ["--config", str(config)]
    script = tmp_path / "client.js"
    script.write_text(NODE_SCRIPT)
    with running(command, tmp_path / "server.log") as server:
        done = subprocess.run(
            [node, str(script), server.url, IMAGE],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "NODE_PATH": str(modules)},
            check=False,
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        reference = httpx.post(
            f"{server.url}/api/chat",
            json={
                "model": "tiny",
                "messages": USER,
                "stream": False,
                "options": {"temperature": 0, "num_predict": 8},
            },
            timeout=60,
        ).json()
    assert out["list"] == ["tiny:latest", "emb:latest"]
    assert "vision" in out["show"]
    assert out["ps"] == ["tiny:latest", "emb:latest"]
    assert out["streamed"] == out["whole"] == reference["message"]["content"]
    assert out["done"] == [True, "length", 8]
    assert out["generate"]
    assert out["embed"] == 2
    assert out["think"]
