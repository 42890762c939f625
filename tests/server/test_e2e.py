"""End to end: ``python -m mlx_pinned.server serve --demo`` in a subprocess on a
free loopback port, driven by the official ``openai`` package."""

from __future__ import annotations

import asyncio
import io
import re
import signal
import sys
import time
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_pinned.server.cli import DEMO_MODEL_NAME, demo_name
from mlx_pinned.server.engine.model import EXACT_FAMILIES
from mlx_pinned.testing import TINY_MODEL_TYPES, image_data_uri, tiny_vlm_path

from .conftest import PROMPT
from .kit import Server, running, running_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("e2e") / "server.log") as running:
        yield running


def vision_messages(image_size: tuple[int, int] = (64, 64), seed: int = 0) -> Any:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": PROMPT},
                {
                    "type": "image_url",
                    "image_url": {"url": image_data_uri(*image_size, seed=seed)},
                },
            ],
        }
    ]


@pytest.mark.slow
def test_bug_report_request_sync(server: Server) -> None:
    completion = server.client().chat.completions.create(
        model=DEMO_MODEL_NAME, messages=vision_messages(), max_tokens=80
    )
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == DEMO_MODEL_NAME
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 80


@pytest.mark.slow
def test_the_demo_embeds_through_the_sdk_beside_its_chat_model(
    server: Server,
) -> None:
    client = server.client()
    answer = client.embeddings.create(
        model=demo_name("embedding"), input=["a red square", "a blue sky"]
    )
    floats = client.embeddings.create(
        model=demo_name("embedding"), input="a red square", encoding_format="float"
    )
    kinds = {model.id: getattr(model, "kind", None) for model in client.models.list()}
    assert [len(item.embedding) for item in answer.data] == [64, 64]
    assert floats.data[0].embedding == answer.data[0].embedding
    assert answer.usage.prompt_tokens > 0
    assert kinds == {
        DEMO_MODEL_NAME: "chat",
        demo_name("embedding"): "embedding",
        demo_name("rerank"): "rerank",
        demo_name("speech"): "speech",
        demo_name("transcription"): "transcription",
    }


@pytest.mark.slow
def test_the_demo_speaks_through_the_sdk_beside_its_chat_model(
    server: Server,
) -> None:
    import io
    import wave

    with (
        server.client() as client,
        client.audio.speech.with_streaming_response.create(
            model=demo_name("speech"),
            voice="vivian",
            input="Hello from the demo.",
            response_format="wav",
        ) as response,
    ):
        raw = response.read()
    with wave.open(io.BytesIO(raw)) as reader:
        assert (reader.getframerate(), reader.getnchannels()) == (24000, 1)
        assert reader.getnframes() > 0


@pytest.mark.slow
def test_the_demo_reranks_beside_its_chat_model(server: Server) -> None:
    answer = httpx.post(
        f"{server.url}/rerank",
        json={
            "model": demo_name("rerank"),
            "query": "a cat",
            "documents": ["a cat on a table", "a blue sky"],
            "return_documents": True,
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1]
    assert {r["document"]["text"] for r in results} == {
        "a cat on a table",
        "a blue sky",
    }


@pytest.mark.slow
def test_the_demo_transcribes_a_file_through_the_sdk(server: Server) -> None:
    sound = io.BytesIO()
    with wave.open(sound, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes(bytes(16000 * 2))  # a second of silence
    client = server.client()
    answer = client.audio.transcriptions.create(
        model=demo_name("transcription"),
        file=("silence.wav", sound.getvalue()),
        temperature=0.2,
    )
    assert answer.text
    assert answer.usage is not None
    assert answer.usage.seconds == 1


def test_streaming_sync_with_usage(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=vision_messages(),
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    plain = server.client().chat.completions.create(
        model=DEMO_MODEL_NAME, messages=vision_messages(), max_tokens=20, temperature=0
    )
    assert text == plain.choices[0].message.content


def test_errors_reach_the_sdk_as_openai_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(
            model="gpt-4o", messages=vision_messages(), max_tokens=2
        )
    assert missing.value.code == "model_not_found"
    bad = vision_messages()
    bad[0]["content"][1]["image_url"]["url"] = "file:///etc/passwd"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=DEMO_MODEL_NAME, messages=bad)
    assert refused.value.param == "messages[0].content[1].image_url"


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_32_concurrent_mixed_requests(server: Server) -> None:
    client = server.async_client()

    async def one(i: int) -> int:
        messages = vision_messages((48 + 8 * (i % 4), 64), seed=i)
        if i % 2:
            stream = await client.chat.completions.create(
                model=DEMO_MODEL_NAME,
                messages=messages,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            assert usage is not None
            return usage.completion_tokens
        completion = await client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=messages, max_tokens=12
        )
        assert completion.usage is not None
        return completion.usage.completion_tokens

    async with client:
        counts = await asyncio.gather(*(one(i) for i in range(32)))
    assert counts == [12] * 32


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_greedy_logprobs_alone_equal_among_16(server: Server) -> None:
    client = server.async_client()
    request: dict[str, Any] = {
        "model": DEMO_MODEL_NAME,
        "messages": vision_messages(),
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "stream": True,
    }

    async def greedy(crowd: bool) -> list[float]:
        values: list[float] = []
        others: list[asyncio.Task[Any]] = []
        stream = await client.chat.completions.create(**request)
        async for chunk in stream:
            if crowd and not others:  # it is generating: now 16 others arrive
                others = [asyncio.create_task(other(i)) for i in range(16)]
            if chunk.choices and chunk.choices[0].logprobs:
                values += [t.logprob for t in chunk.choices[0].logprobs.content or []]
        await asyncio.gather(*others)
        return values

    async def other(i: int) -> None:
        completion = await client.chat.completions.create(
            model=DEMO_MODEL_NAME,
            messages=vision_messages((32 + 16 * (i % 6), 128 - 16 * (i % 5)), seed=i),
            max_tokens=8 + i,
            temperature=0.7,
        )
        assert completion.choices[0].message.content is not None

    async with client:
        alone = await greedy(crowd=False)
        among = await greedy(crowd=True)
    assert len(alone) == len(among) == 40
    assert among == pytest.approx(alone, abs=1e-5)


def health(server: Server) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server.url}/health").json()
    return body


def decoding(server: Server, model: str) -> tuple[float, float]:
    """``model``'s decode steps and the tokens they gave, so far (counted
    by the server, not sampled)."""
    text = httpx.get(f"{server.url}/metrics").text
    found = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == model
    }
    return found["mlx_pinned_decode_steps_total"], found[
        "mlx_pinned_decode_tokens_total"
    ]


@pytest.mark.slow
def test_an_idle_connection_outlives_the_clients_pool(server: Server) -> None:
    # httpx (and so the openai package) keeps an idle connection 5 s; the
    # server keeps it longer, so a request is never sent on a connection the
    # server is closing (uvicorn's own default, 5 s, raced with the client).
    with server.http(limits=httpx.Limits(keepalive_expiry=60), timeout=10) as client:
        first = client.get("/health")
        assert first.status_code == 200
        time.sleep(6)
        again = client.get("/v1/models")
        assert again.status_code == 200

        def local_address(response: httpx.Response) -> Any:
            return response.extensions["network_stream"].get_extra_info("client_addr")

        assert local_address(again) == local_address(first)  # the same connection


def test_disconnect_mid_stream_closes_the_generation(server: Server) -> None:
    body = {
        "model": DEMO_MODEL_NAME,
        "messages": vision_messages(),
        "max_tokens": 3000,
        "stream": True,
    }
    with (
        server.http(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert health(server)["open_streams"] == 1
    deadline = time.monotonic() + 30
    while health(server)["open_streams"] != 0:
        assert time.monotonic() < deadline, "the generation was not closed"
        time.sleep(0.01)
    match = None
    while match is None:
        match = re.search(r"completion=(\d+) .*client disconnected", server.log_text())
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert int(match.group(1)) < 3000


def drains_then_exits_0(server: Server, signum: signal.Signals) -> None:
    """A stream in flight when ``signum`` arrives finishes; the server stops
    accepting, then exits 0."""
    body = {
        "model": DEMO_MODEL_NAME,
        "messages": vision_messages(),
        "max_tokens": 400,  # still generating when the signal arrives
        "stream": True,
    }
    with (
        server.http(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.process.send_signal(signum)
        deadline = time.monotonic() + 10
        while True:  # it stops accepting while the stream goes on
            try:
                status = httpx.get(f"{server.url}/health", timeout=5).status_code
            except httpx.TransportError:
                break  # no longer accepting connections
            if status == 503:
                break
            assert time.monotonic() < deadline, "still accepting requests"
            time.sleep(0.02)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert server.process.wait(timeout=30) == 0
    log = server.log_text()
    assert "There is no Stream" not in log
    assert "Traceback" not in log
    assert " ERROR " not in log
    assert "Application shutdown complete" in log
    # The server extra's event loop and parser, and the frozen start-up heap.
    assert "(event loop: uvloop, HTTP parser: httptools)" in log
    assert re.search(r"froze \d+ objects", log)


@pytest.mark.slow
def test_sigterm_drains_and_exits_cleanly(server: Server) -> None:
    # Runs last in this module: it stops the shared server.
    drains_then_exits_0(server, signal.SIGTERM)
    lines = re.findall(
        r"POST /v1/chat/completions (\d+) .* ttft=.* tok/s", server.log_text()
    )
    assert len(lines) >= 3
    assert not [status for status in lines if status.startswith("5")]


# -- every vision family ---------------------------------------------------------


@pytest.fixture(scope="module")
def all_families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server of every vision family's tiny model (written offline),
    each served under its ``model_type``: each has its own batch."""
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += [str(tiny_vlm_path(model_type)) for model_type in TINY_MODEL_TYPES]
    for model_type in TINY_MODEL_TYPES:
        command += ["--served-model-name", model_type]
    command += ["--port", "0", "--max-tokens-limit", "4000"]
    log = tmp_path_factory.mktemp("e2e-families") / "server.log"
    with running(command, log) as served:
        yield served


@pytest.fixture(params=TINY_MODEL_TYPES)
def family(request: pytest.FixtureRequest, all_families: Server) -> tuple[str, Server]:
    """A vision family's name on the server of every family."""
    return request.param, all_families


def family_messages(size: tuple[int, int], seed: int, text: str = PROMPT) -> Any:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {
                    "type": "image_url",
                    "image_url": {"url": image_data_uri(*size, seed=seed)},
                },
            ],
        }
    ]


def logprob_values(completion: Any) -> list[float]:
    content = completion.choices[0].logprobs.content or []
    return [token.logprob for token in content]


@pytest.mark.slow
class TestEveryVisionFamily:
    """The distinctive checks, over HTTP, for each vision family of
    ``TINY_MODEL_TYPES``, each a model of one server."""

    def test_vision_chat_and_its_stream_agree(self, family: tuple[str, Server]) -> None:
        name, served = family
        client = served.client()
        request: dict[str, Any] = {
            "model": name,
            "messages": family_messages((64, 48), seed=1),
            "max_tokens": 16,
            "temperature": 0,
        }
        plain = client.chat.completions.create(**request)
        assert plain.model == name
        assert plain.choices[0].finish_reason == "length"
        assert plain.usage is not None
        assert plain.usage.completion_tokens == 16
        assert plain.usage.prompt_tokens > 10  # the image's tokens among them
        chunks = list(
            client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 16

    def test_the_image_reaches_the_model(self, family: tuple[str, Server]) -> None:
        name, served = family
        client = served.client()

        def greedy(seed: int) -> list[float]:
            completion = client.chat.completions.create(
                model=name,
                messages=family_messages((64, 64), seed=seed),
                max_tokens=3,
                temperature=0,
                logprobs=True,
            )
            return logprob_values(completion)

        assert greedy(0) != greedy(1)

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_greedy_alone_equals_among_16_different_images(
        self, family: tuple[str, Server]
    ) -> None:
        name, served = family
        client = served.async_client()
        request: dict[str, Any] = {
            "model": name,
            "messages": family_messages((64, 64), seed=0),
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }

        async def other(i: int) -> int:
            completion = await client.chat.completions.create(
                model=name,
                messages=family_messages(
                    (32 + 16 * (i % 5), 96 - 16 * (i % 4)), seed=10 + i
                ),
                max_tokens=6 + i % 7,
                temperature=0.7,
                seed=i,
            )
            assert completion.usage is not None
            return completion.usage.completion_tokens

        async with client:
            alone = await client.chat.completions.create(**request)
            before = decoding(served, name)
            stream = await client.chat.completions.create(**request, stream=True)
            among: list[Any] = []
            others: list[asyncio.Task[int]] = []
            async for chunk in stream:
                if not others:  # it is generating: now 16 others arrive
                    others = [asyncio.create_task(other(i)) for i in range(16)]
                if chunk.choices and chunk.choices[0].logprobs:
                    among += chunk.choices[0].logprobs.content or []
            counts = await asyncio.gather(*others)
        after = decoding(served, name)
        steps, tokens = after[0] - before[0], after[1] - before[1]
        # A sampled special token may end one early.
        assert all(1 <= n <= 6 + i % 7 for i, n in enumerate(counts))
        expected = alone.choices[0].logprobs
        assert expected is not None
        assert expected.content is not None
        assert [t.token for t in among] == [t.token for t in expected.content]
        assert [t.logprob for t in among] == pytest.approx(
            [t.logprob for t in expected.content], abs=1e-5
        )
        for mine, theirs in zip(among, expected.content, strict=True):
            assert [t.logprob for t in mine.top_logprobs] == pytest.approx(
                [t.logprob for t in theirs.top_logprobs], abs=1e-5
            )
        if name in EXACT_FAMILIES:  # rows of different images together
            assert tokens > steps  # some steps decoded several rows

    @pytest.mark.anyio
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_a_seeded_request_samples_the_same_among_others(
        self, family: tuple[str, Server]
    ) -> None:
        name, served = family
        client = served.async_client()
        request: dict[str, Any] = {
            "model": name,
            "messages": family_messages((48, 48), seed=3),
            "max_tokens": 12,
            "temperature": 0.9,
            "top_p": 0.9,
            "seed": 1234,
            "logprobs": True,
        }

        async def other(i: int) -> None:
            await client.chat.completions.create(
                model=name,
                messages=family_messages((64, 32 + 16 * i), seed=20 + i),
                max_tokens=10,
                temperature=0.9,
            )

        async with client:
            alone = await client.chat.completions.create(**request)
            results = await asyncio.gather(
                client.chat.completions.create(**request),
                *(other(i) for i in range(4)),
            )
            other_seed = await client.chat.completions.create(
                **{**request, "seed": 4321}
            )
        among = results[0]
        assert among.choices[0].message.content == alone.choices[0].message.content
        assert logprob_values(among) == pytest.approx(logprob_values(alone), abs=1e-5)
        assert logprob_values(other_seed) != logprob_values(alone)

    def test_a_disconnect_ends_the_generation(self, family: tuple[str, Server]) -> None:
        name, served = family
        body = {
            "model": name,
            "messages": family_messages((64, 64), seed=5),
            "max_tokens": 3000,
            "stream": True,
        }
        with (
            served.http(timeout=30) as client,
            client.stream(
                "POST", f"{served.url}/v1/chat/completions", json=body
            ) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(5):
                next(lines)
        deadline = time.monotonic() + 30
        while health(served)["open_streams"] != 0:
            assert time.monotonic() < deadline, "the generation was not closed"
            time.sleep(0.01)
        match = None
        while match is None:
            pattern = rf"completion=(\d+) .* model={name} \(client disconnected\)"
            found = re.findall(pattern, served.log_text())
            match = found[-1] if found else None
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert int(match) < 3000
        assert " ERROR " not in served.log_text()
        assert "Traceback" not in served.log_text()
