"""The legacy ``POST /v1/completions`` and vLLM's ``/tokenize`` and
``/detokenize``: the ``openai`` SDK against a real server, exactness against
chat completions, batched against solo, the legacy logprobs shape, echo,
refused fields and hostile bodies."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.testing import tiny_lm_path, tiny_vlm_path

from .conftest import assert_error, drive, sse_events
from .kit import Lifespan, Serve, Served, Server, in_process, running
from .openapi import CheckedTransport

pytestmark = pytest.mark.timeout(180)

TOL = 1e-5
# Both kinds of model: a vision model (Qwen3-VL) and a text model (Qwen3).
MODELS = ("vlm", "lm")
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http(timeout=60) as client:
        return client.post(path, json=body)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``serve`` of the tiny vision and text models on a free loopback port."""
    log = tmp_path_factory.mktemp("completions") / "server.log"
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += [str(tiny_vlm_path()), str(tiny_lm_path("qwen3"))]
    command += ["--served-model-name", "vlm", "--served-model-name", "lm"]
    command += ["--port", "0", "--max-num-seqs", "8"]
    with running(command, log) as served:
        yield served


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
class TestTheSDK:
    def test_completions_create(self, server: Server, model: str) -> None:
        completion = server.client().completions.create(
            model=model, prompt="Once upon a time", max_tokens=6, temperature=0
        )
        assert completion.object == "text_completion"
        assert completion.id.startswith("cmpl-")
        (choice,) = completion.choices
        assert isinstance(choice.text, str)
        assert choice.index == 0
        assert choice.finish_reason in ("stop", "length")
        assert completion.usage is not None
        assert completion.usage.prompt_tokens > 0
        assert completion.usage.total_tokens == (
            completion.usage.prompt_tokens + completion.usage.completion_tokens
        )

    def test_a_stream_joins_to_the_whole_answer(
        self, server: Server, model: str
    ) -> None:
        client = server.client()
        asked: dict[str, Any] = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 0,
        }
        whole = client.completions.create(**asked)
        chunks = list(
            client.completions.create(
                **asked, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert chunks[-1].choices == []
        assert chunks[-1].usage == whole.usage
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == whole.choices[0].finish_reason
        assert all(reason is None for reason in reasons[:-1])

    def test_a_chat_sent_as_its_tokens_answers_as_the_chat(
        self, server: Server, model: str
    ) -> None:
        # The chat template's rendering, through /tokenize, then the same ids
        # as a raw prompt: the same tokens and log-probabilities.
        rendered = post(server, "/tokenize", {"model": model, "messages": CHAT})
        assert rendered.status_code == 200, rendered.text
        tokens = rendered.json()["tokens"]
        client = server.client()
        chat = client.chat.completions.create(
            model=model,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        assert chat.choices[0].logprobs is not None
        expected = chat.choices[0].logprobs.content or []
        assert len(expected) >= 4  # something to compare
        completion = client.completions.create(
            model=model, prompt=tokens, max_tokens=16, temperature=0, logprobs=2
        )
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.tokens == [t.token for t in expected]
        assert logprobs.token_logprobs == pytest.approx(
            [t.logprob for t in expected], abs=TOL
        )
        assert completion.usage is not None
        assert chat.usage is not None
        assert completion.usage.prompt_tokens == chat.usage.prompt_tokens
        assert completion.choices[0].finish_reason == chat.choices[0].finish_reason


@pytest.fixture(params=["qwen3_vl", "qwen3"])
async def served(
    request: pytest.FixtureRequest, lifespan: Lifespan
) -> AsyncIterator[Served]:
    """A vision model and a text model, in-process, eight rows a batch."""
    path = tiny_vlm_path() if request.param == "qwen3_vl" else tiny_lm_path()
    app = create_app(path, served_model_name="tiny", max_num_seqs=8)
    async with in_process(app, lifespan, Served) as served:
        yield served


@pytest.mark.anyio
async def test_a_stream_is_sent_as_it_comes(lifespan: Lifespan) -> None:
    # Not the whole answer at the end: a write as tokens come (no interval).
    app = create_app(tiny_lm_path(), served_model_name="tiny", stream_write_interval=0)
    asked = body("Once upon a time", 64, stream=True, temperature=0)
    async with lifespan(app):
        with anyio.fail_after(60):
            status, sent = await drive(app, asked, path="/v1/completions")
    assert status == 200
    assert len(sent) >= 3  # the first token, more tokens, the end
    events = [e for m in sent for e in sse_events(m.decode())]
    assert events[-1] == "[DONE]"
    assert sum(len(e["choices"]) for e in events[:-1]) >= 3


def body(prompt: Any, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **fields,
    }


PROMPTS = (
    "The sea is",
    "A long time ago, in a land far away, there lived",
    "Hello",
    "Numbers: one, two, three,",
    "Why is the sky blue? Because",
    "Once",
)


@pytest.mark.anyio
class TestCompletions:
    @pytest.mark.slow
    async def test_prompts_batched_equal_each_alone(self, served: Served) -> None:
        async def logprobs(answer: httpx.Response) -> list[list[float]]:
            assert answer.status_code == 200, answer.text
            return [c["logprobs"]["token_logprobs"] for c in answer.json()["choices"]]

        alone = []
        for prompt in PROMPTS:
            (one,) = await logprobs(
                await served.client.post(
                    "/v1/completions", json=body(prompt, 12, logprobs=1)
                )
            )
            alone.append(one)
        # All six in one request (a choice and a row each), with two more
        # requests arriving beside it.
        together: dict[str, list[list[float]]] = {}

        async def send(name: str, prompts: Any) -> None:
            answer = await served.client.post(
                "/v1/completions", json=body(prompts, 12, logprobs=1)
            )
            together[name] = await logprobs(answer)

        async with anyio.create_task_group() as group:
            group.start_soon(send, "all", list(PROMPTS))
            group.start_soon(send, "first", PROMPTS[0])
            group.start_soon(send, "last", [PROMPTS[-1]])
        assert len(together["all"]) == len(PROMPTS)
        for got, expected in zip(together["all"], alone, strict=True):
            assert got == pytest.approx(expected, abs=TOL)
        assert together["first"][0] == pytest.approx(alone[0], abs=TOL)
        assert together["last"][0] == pytest.approx(alone[-1], abs=TOL)
        assert served.engine.statistics().peak_active >= 2

    async def test_the_legacy_logprobs_shape(self, served: Served) -> None:
        answer = await served.client.post(
            "/v1/completions", json=body("The sea", logprobs=3)
        )
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        logprobs = choice["logprobs"]
        assert set(logprobs) == {
            "tokens",
            "token_logprobs",
            "top_logprobs",
            "text_offset",
        }
        count = answer.json()["usage"]["completion_tokens"]
        assert count == 8
        for values in logprobs.values():
            assert len(values) == count
        offset = 0
        for token, logprob, top, at in zip(*logprobs.values(), strict=True):
            assert at == offset
            offset += len(token)
            assert 1 <= len(top) <= 3
            assert logprob <= 0
            assert max(top.values()) >= logprob - TOL  # greedy: the best
        assert "".join(logprobs["tokens"]) == choice["text"]
        zero = await served.client.post(
            "/v1/completions", json=body("The sea", logprobs=0)
        )
        (choice,) = zero.json()["choices"]
        assert choice["logprobs"]["top_logprobs"] == [{}] * 8
        none = await served.client.post("/v1/completions", json=body("The sea"))
        assert none.json()["choices"][0]["logprobs"] is None

    async def test_echo_puts_the_prompt_first(self, served: Served) -> None:
        plain = await served.client.post("/v1/completions", json=body("The sea is"))
        echoed = await served.client.post(
            "/v1/completions", json=body("The sea is", echo=True)
        )
        text = plain.json()["choices"][0]["text"]
        assert echoed.json()["choices"][0]["text"] == "The sea is" + text
        ids = await served.client.post(
            "/tokenize", json={"model": "tiny", "prompt": "Sea"}
        )
        tokens = ids.json()["tokens"]
        by_ids = await served.client.post(
            "/v1/completions", json=body(tokens, echo=True)
        )
        assert by_ids.json()["choices"][0]["text"].startswith("Sea")
        streamed = await served.client.post(
            "/v1/completions", json=body("The sea is", echo=True, stream=True)
        )
        events = sse_events(streamed.text)
        assert events[0]["choices"][0]["text"] == "The sea is"
        assert events[-1] == "[DONE]"
        joined = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert joined == "The sea is" + text

    async def test_a_stream_of_several_prompts_names_each_choice(
        self, served: Served
    ) -> None:
        whole = await served.client.post(
            "/v1/completions", json=body(["Hello", "The sea"])
        )
        streamed = await served.client.post(
            "/v1/completions",
            json=body(
                ["Hello", "The sea"],
                stream=True,
                stream_options={"include_usage": True},
            ),
        )
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"] == []
        assert events[-2]["usage"] == whole.json()["usage"]
        for index, choice in enumerate(whole.json()["choices"]):
            mine = [c for e in events[:-2] for c in e["choices"] if c["index"] == index]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert mine[-1]["finish_reason"] == choice["finish_reason"]

    async def test_stop_ends_the_text_before_it(self, served: Served) -> None:
        free = await served.client.post("/v1/completions", json=body("The sea", 12))
        text = free.json()["choices"][0]["text"]
        stop = text[3:5]
        cut = await served.client.post(
            "/v1/completions", json=body("The sea", 12, stop=stop)
        )
        (choice,) = cut.json()["choices"]
        assert choice["finish_reason"] == "stop"
        assert choice["text"] == text[: text.index(stop)]

    @pytest.mark.parametrize(
        ("fields", "param", "code"),
        [
            ({"suffix": "end"}, "suffix", "unsupported_parameter"),
            ({"n": 2}, "n", "unsupported_parameter"),
            ({"best_of": 3}, "best_of", "unsupported_parameter"),
            (
                {"echo": True, "logprobs": 1, "stream": True},
                "stream",
                "unsupported_value",
            ),
            ({"max_tokens": 0}, "max_tokens", "invalid_value"),
            ({"logprobs": 6}, "logprobs", None),
            ({"logprobs": True}, "logprobs", None),
            ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
            ({"logit_bias": {"99999": 1}}, "logit_bias", "invalid_value"),
            ({"logit_bias": {"x": 1}}, "logit_bias", None),
            ({"max_tokens": 10**6}, "max_tokens", "invalid_value"),
            ({"temperature": 3}, "temperature", None),
            ({"functions": []}, "functions", "unknown_parameter"),
            ({"prompt": ""}, "prompt", None),
            ({"prompt": []}, "prompt", "empty_array"),
            ({"prompt": [[]]}, "prompt[0]", None),
            ({"prompt": [1, "a"]}, "prompt[0]", None),
            ({"prompt": [True]}, "prompt[0]", None),
            ({"prompt": [-1]}, "prompt[0]", None),
            ({"prompt": [10**7]}, "prompt", "invalid_value"),
            ({"prompt": ["x"] * 65}, "prompt", None),
            ({"prompt": {"text": "x"}}, "prompt", None),
            ({"prompt": [1] * 40000}, "prompt", "context_length_exceeded"),
            ({"prompt": "word " * 300000}, "prompt", "context_length_exceeded"),
        ],
    )
    async def test_refused_by_name(
        self,
        served: Served,
        fields: dict[str, Any],
        param: str,
        code: str | None,
    ) -> None:
        before = served.thread.statistics().completed
        answer = await served.client.post(
            "/v1/completions", json={**body("Hi"), **fields}
        )
        assert_error(answer, 400, param, code)
        # Refused on the event loop: nothing ran on the MLX thread.
        after = served.thread.statistics().completed
        assert after == before

    async def test_an_image_placeholder_in_a_prompt_is_refused(
        self, served: Served
    ) -> None:
        placeholder = getattr(served.model.config, "image_token_id", None)
        if placeholder is None:  # a text model: its ids are all text
            placeholder = 1
            answer = await served.client.post(
                "/v1/completions", json=body([2, placeholder])
            )
            assert answer.status_code == 200, answer.text
            return
        answer = await served.client.post(
            "/v1/completions", json=body([5, placeholder])
        )
        error = assert_error(answer, 400, "prompt", "invalid_prompt")
        assert "placeholder" in error["message"]

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "raw",
        [
            b"not json",
            b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            b'{"model": "tiny", "prompt": "x", "max_tokens": "8"}',
            b'{"model": "tiny", "prompt": null}',
            b'{"model": 7, "prompt": "x"}',
            b'{"model": "nope", "prompt": "x"}',
            b"[]",
            b'{"model": "tiny", "prompt": "x", "stream_options": [1]}',
            b'{"model": "tiny", "prompt": "x", "seed": 1e400}',
            b'{"model": "tiny", "prompt": [[1, 2], [3, "4"]]}',
        ],
    )
    async def test_hostile_bodies_are_4xx(self, served: Served, raw: bytes) -> None:
        for path in ("/v1/completions", "/tokenize", "/detokenize"):
            answer = await served.client.post(path, content=raw)
            assert 400 <= answer.status_code < 500, (path, answer.text)
            assert set(answer.json()) == {"error"}


@pytest.mark.anyio
class TestTokenize:
    async def test_a_prompt_round_trips(self, served: Served) -> None:
        text = "The sea is calm tonight."
        answer = await served.client.post(
            "/tokenize",
            json={"model": "tiny", "prompt": text, "return_token_strs": True},
        )
        assert answer.status_code == 200, answer.text
        tokenized = answer.json()
        assert tokenized["count"] == len(tokenized["tokens"]) > 0
        assert tokenized["max_model_len"] == 32768  # the tiny models' context
        assert "".join(tokenized["token_strs"]) == text
        back = await served.client.post(
            "/detokenize", json={"model": "tiny", "tokens": tokenized["tokens"]}
        )
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": text}
        plain = await served.client.post(
            "/tokenize", json={"model": "tiny", "prompt": "x"}
        )
        assert "token_strs" not in plain.json()

    async def test_messages_render_through_the_chat_template(
        self, served: Served
    ) -> None:
        chat = {"model": "tiny", "messages": CHAT}
        prompted = (await served.client.post("/tokenize", json=chat)).json()
        bare = await served.client.post(
            "/tokenize", json={**chat, "add_generation_prompt": False}
        )
        assert bare.json()["count"] < prompted["count"]
        assert prompted["tokens"][: bare.json()["count"]] == bare.json()["tokens"]
        text = (
            await served.client.post(
                "/detokenize", json={"model": "tiny", "tokens": prompted["tokens"]}
            )
        ).json()["prompt"]
        assert "Tell me about the sea." in text
        # The same ids as a raw text prompt, without the tokenizer's own extras.
        again = await served.client.post(
            "/tokenize",
            json={"model": "tiny", "prompt": text, "add_special_tokens": False},
        )
        assert again.json()["tokens"] == prompted["tokens"]

    @pytest.mark.parametrize(
        ("path", "fields", "status", "param"),
        [
            ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
            ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
            ("/tokenize", {"messages": []}, 400, "messages"),
            (
                "/tokenize",
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                400,
                "messages[0].content[0].type",
            ),
            (
                "/tokenize",
                {"messages": CHAT, "add_special_tokens": True},
                400,
                "add_special_tokens",
            ),
            ("/tokenize", {"prompt": "word " * 300000}, 400, "prompt"),
            ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
            ("/detokenize", {"tokens": [1] * 40000}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
            ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ],
    )
    async def test_refused_by_name(
        self,
        served: Served,
        path: str,
        fields: dict[str, Any],
        status: int,
        param: str | None,
    ) -> None:
        answer = await served.client.post(path, json={"model": "tiny", **fields})
        assert answer.status_code == status, answer.text
        if param is not None:
            assert answer.json()["error"]["param"] == param


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_the_engine_finds_too_long_is_a_400_naming_prompt(
    lifespan: Lifespan, stream: bool
) -> None:
    # Few enough characters to pass the event loop's bound, too many tokens
    # for the limit: refused at prefill, before the first byte of a stream.
    app = create_app(tiny_lm_path(), served_model_name="tiny", max_prompt_tokens=4)
    transport = CheckedTransport(httpx.ASGITransport(app=app))
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        prompt = "a b c d e f g h i j"
        many = await client.post("/tokenize", json={"model": "tiny", "prompt": prompt})
        assert many.json()["count"] > 4
        # Unstreamed, with a prompt that is fine: one refused fails them all.
        prompts = [prompt] if stream else ["ok", prompt]
        answer = await client.post(
            "/v1/completions", json=body(prompts, 4, stream=stream)
        )
        assert_error(answer, 400, "prompt", "context_length_exceeded")
        fine = await client.post("/v1/completions", json=body("ok", 4, stream=stream))
        assert fine.status_code == 200, fine.text


@pytest.mark.anyio
async def test_each_route_is_its_own_metrics_label(serve: Serve) -> None:
    async with serve() as served:
        for path in ("/v1/completions", "/tokenize", "/detokenize"):
            assert served.app.state.metrics.route_of(path) == path
