"""``POST /v1/embeddings``: OpenAI's shape through the openai SDK, batched
passes on the MLX thread that equal each input alone, Matryoshka widths,
hostile inputs (never a 5xx), and embedding models as models of the one
registry (their kind, loaded on first use, unloaded when idle)."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import numpy as np
import pytest
from conftest import run_uvicorn

from mlx_pinned.server import ServerConfig, create_app
from mlx_pinned.server.config import SettingError
from mlx_pinned.server.kinds.embedding.engine import EmbeddingEngine
from mlx_pinned.server.kinds.embedding.values import EmbeddingParams
from mlx_pinned.testing import make_tiny_embedding, tiny_embedding_path

from .conftest import assert_error, until
from .kit import TOL, Lifespan, Served, chat_beside, serving_kind

pytestmark = pytest.mark.anyio

MODEL = "emb"
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello!",
    "A small red square sits on a blue background, next to a cup of tea.",
    "cat",
)

ServeEmbedding = Callable[..., AbstractAsyncContextManager[Served]]


@pytest.fixture(scope="session")
def embedding_path() -> Path:
    return tiny_embedding_path()


@pytest.fixture
def serve_embedding(embedding_path: Path, lifespan: Lifespan) -> ServeEmbedding:
    """An app serving the tiny embedding model as ``emb`` (and whatever
    else a test names), its lifespan running."""
    return serving_kind(embedding_path, "embedding", MODEL, lifespan)


def engine_of(served: Served, name: str = MODEL) -> EmbeddingEngine:
    engine = served.app.state.models.get(name).engine()
    assert isinstance(engine, EmbeddingEngine)
    return engine


async def embed(served: Served, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    return await served.client.post("/v1/embeddings", json=body)


def vectors(response: httpx.Response) -> list[list[float]]:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return [item["embedding"] for item in data]


async def test_langchain_embeds_documents_and_queries(
    serve_embedding: ServeEmbedding,
) -> None:
    """LangChain's ``OpenAIEmbeddings`` sends the texts themselves
    (``check_embedding_ctx_length=False``: its default cuts them with
    tiktoken, whose files are downloaded at run time) as base64."""
    from langchain_openai import OpenAIEmbeddings

    async with serve_embedding() as served:
        embedder = OpenAIEmbeddings(
            model=MODEL,
            base_url="http://test/v1",
            api_key="unused",  # type: ignore[arg-type]
            http_async_client=served.client,
            check_embedding_ctx_length=False,
            chunk_size=2,  # two requests of two texts, and one of one
        )
        documents = await embedder.aembed_documents(list(TEXTS[:3]))
        query = await embedder.aembed_query(TEXTS[0])
        direct = vectors(await embed(served, input=list(TEXTS[:3])))
    assert len(documents) == 3
    assert query == pytest.approx(documents[0], abs=1e-6)
    for got, expected in zip(documents, direct, strict=True):
        assert got == pytest.approx(expected, abs=1e-6)


async def test_the_openai_sdk_embeds_texts_as_unit_vectors(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        sdk = served.sdk()
        answer = await sdk.embeddings.create(model=MODEL, input=list(TEXTS))
        tokenizer = engine_of(served).loaded.tokenizer
        counted = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
        as_floats = await sdk.embeddings.create(
            model=MODEL, input=list(TEXTS), encoding_format="float"
        )
    assert answer.model == MODEL
    assert [item.index for item in answer.data] == [0, 1, 2, 3]
    for item in answer.data:
        assert len(item.embedding) == 64
        assert np.linalg.norm(item.embedding) == pytest.approx(1.0, abs=1e-5)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == counted
    # The SDK asks for base64 unless told: both encodings carry the same floats.
    assert [i.embedding for i in as_floats.data] == [i.embedding for i in answer.data]
    assert len({tuple(item.embedding) for item in answer.data}) == len(TEXTS)


@pytest.mark.slow
async def test_base64_is_the_little_endian_float32_of_the_floats(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        floats = vectors(await embed(served, input="Hello!"))[0]
        raw = await embed(served, input="Hello!", encoding_format="base64")
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == floats


@pytest.mark.slow
async def test_token_ids_embed_as_the_text_they_tokenize_to(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        tokenizer = engine_of(served).loaded.tokenizer
        ids = [tokenizer(text)["input_ids"] for text in TEXTS[:2]]
        from_text = vectors(await embed(served, input=list(TEXTS[:2])))
        from_ids = vectors(await embed(served, input=ids))
        one = await embed(served, input=ids[0])
    assert np.abs(np.array(from_ids) - np.array(from_text)).max() <= TOL
    assert vectors(one) == from_ids[:1]
    assert one.json()["usage"]["prompt_tokens"] == len(ids[0])


@pytest.mark.slow
async def test_a_batch_equals_each_input_alone(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        together = vectors(await embed(served, input=list(TEXTS)))
        alone = [vectors(await embed(served, input=text))[0] for text in TEXTS]
        again = vectors(await embed(served, input=list(TEXTS)))
    assert np.abs(np.array(together) - np.array(alone)).max() <= TOL
    assert again == together  # the same inputs, the same vectors


@pytest.mark.slow
async def test_concurrent_requests_share_passes_and_equal_each_alone(
    serve_embedding: ServeEmbedding,
) -> None:
    bodies = [list(TEXTS[i % 4 :] + TEXTS[: i % 4])[: 1 + i % 4] for i in range(16)]
    async with serve_embedding(max_num_seqs=16) as served:
        alone = {text: vectors(await embed(served, input=text))[0] for text in TEXTS}
        engine = engine_of(served)
        before = engine.loop.passes
        answers: list[list[list[float]]] = [[] for _ in bodies]

        async def one(index: int) -> None:
            answers[index] = vectors(await embed(served, input=bodies[index]))

        async with anyio.create_task_group() as tasks:
            for index in range(len(bodies)):
                tasks.start_soon(one, index)
        passes = engine.loop.passes - before
    assert passes < len(bodies), "concurrent requests shared no pass"
    for body, answer in zip(bodies, answers, strict=True):
        expected = np.array([alone[text] for text in body])
        assert np.abs(np.array(answer) - expected).max() <= TOL


@pytest.mark.slow
async def test_a_large_request_is_cut_into_passes(
    serve_embedding: ServeEmbedding,
) -> None:
    texts = [f"{TEXTS[i % 4]} {i}" for i in range(300)]
    async with serve_embedding() as served:
        engine = engine_of(served)
        before = engine.loop.passes
        answer = vectors(await embed(served, input=texts))
        passes = engine.loop.passes - before
        first = vectors(await embed(served, input=texts[0]))[0]
    assert len(answer) == 300
    assert passes >= 300 // engine.loop.batch_size
    assert np.abs(np.array(answer[0]) - np.array(first)).max() <= TOL


@pytest.mark.slow
async def test_dimensions_cut_a_matryoshka_vector_and_normalise_it_again(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        full = np.array(vectors(await embed(served, input="Hello!"))[0])
        cut = np.array(vectors(await embed(served, input="Hello!", dimensions=16))[0])
        untrained = await embed(served, input="Hello!", dimensions=48)
        wider = await embed(served, input="Hello!", dimensions=65)
        zero = await embed(served, input="Hello!", dimensions=0)
    assert cut.shape == (16,)
    assert np.linalg.norm(cut) == pytest.approx(1.0, abs=1e-6)
    expected = full[:16] / np.linalg.norm(full[:16])
    assert np.abs(cut - expected).max() <= TOL
    assert "16, 32, 64" in assert_error(untrained, 400, "dimensions")["message"]
    assert "64 values" in assert_error(wider, 400, "dimensions")["message"]
    assert_error(zero, 400, "dimensions")


@pytest.mark.slow
async def test_a_model_not_trained_matryoshka_style_takes_no_dimensions(
    serve_embedding: ServeEmbedding, tmp_path: Path
) -> None:
    folder = make_tiny_embedding(tmp_path / "plain")
    config = json.loads((folder / "config.json").read_text())
    del config["matryoshka_dimensions"]
    (folder / "config.json").write_text(json.dumps(config))
    async with serve_embedding(model=folder) as served:
        refused = await embed(served, input="Hello!", dimensions=16)
        full = await embed(served, input="Hello!")
    assert "Matryoshka" in assert_error(refused, 400, "dimensions")["message"]
    assert len(vectors(full)[0]) == 64


HOSTILE: list[tuple[str, Any, str | None]] = [
    ("an empty string", "", "input"),
    ("an empty list", [], "input"),
    ("an empty string in a list", ["a", ""], "input"),
    ("an empty list of ids", [[1, 2], []], "input"),
    ("a number", 5, "input"),
    ("a float id", [1.5], "input"),
    ("a boolean id", [True], "input"),
    ("a negative id", [-1], "input"),
    ("an object", {"text": "a"}, "input"),
    ("texts and ids mixed", ["a", 1], "input"),
    ("texts nested", [["a"]], "input"),
    ("null", None, "input"),
    ("too many inputs", ["a"] * 10_000, "input"),
    ("an id out of the vocabulary", [1, 384], "input"),
    ("a huge id", [[10**30]], "input"),
    ("a text longer than the model's positions", "cat " * 400, "input"),
    ("ids more than the model's positions", [5] * 129, "input"),
]


@pytest.mark.parametrize(
    ("value", "param"),
    [pytest.param(v, p, id=name) for name, v, p in HOSTILE],
)
async def test_hostile_inputs_are_a_400_that_names_input(
    serve_embedding: ServeEmbedding, value: Any, param: str
) -> None:
    async with serve_embedding() as served:
        answer = await embed(served, input=value)
        after = await embed(served, input="cat")
    assert answer.status_code == 400, answer.text
    named = answer.json()["error"]["param"]
    assert named == param or named.startswith(f"{param}["), named
    assert after.status_code == 200  # the server is fine


@pytest.mark.slow
async def test_the_longest_input_is_named_by_its_index(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        answer = await embed(served, input=["cat", "dog", "cat " * 400])
        exact = await embed(served, input=[[5] * 128])
    assert "input 2 has" in assert_error(answer, 400, "input")["message"]
    assert exact.status_code == 200, exact.text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"dimensions": "16"}, "dimensions"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"model": 3}, "model"),
        ({"model": "other"}, "model"),
    ],
)
async def test_wrong_fields_are_refused_by_name(
    serve_embedding: ServeEmbedding, body: dict[str, Any], param: str
) -> None:
    async with serve_embedding() as served:
        answer = await embed(served, input="cat", **body)
    assert_error(answer, 404 if body.get("model") == "other" else 400, param)


@pytest.mark.slow
async def test_a_body_that_is_not_json_is_a_400(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        broken = await served.client.post("/v1/embeddings", content=b"{not json")
        listed = await served.client.post("/v1/embeddings", content=b"[1, 2]")
    assert broken.status_code == 400
    assert listed.status_code == 400


@pytest.mark.slow
async def test_each_kind_is_sent_to_its_own_routes(
    serve_embedding: ServeEmbedding, tiny_model_path: Path
) -> None:
    async with serve_embedding(
        model=[tiny_model_path, tiny_embedding_path()],
        served_model_name=("chat", MODEL),
        model_kind="chat",
        model_settings=({}, {"model_kind": "embedding"}),
    ) as served:
        chat_here = await embed(served, model="chat", input="cat")
        emb_there = await served.chat(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        tokenize = await served.client.post(
            "/tokenize", json={"model": MODEL, "prompt": "hi"}
        )
        chat = await served.chat(
            {
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
        )
        embedded = await embed(served, input="cat")
        listing = (await served.client.get("/v1/models")).json()["data"]
        health = (await served.client.get("/health")).json()
        metrics = await served.client.get("/metrics")
    assert metrics.status_code == 200
    assert f'mlx_pinned_model_loaded{{model="{MODEL}"}} 1.0' in metrics.text
    error = assert_error(chat_here, 400, "model", "wrong_model_kind")
    assert "/v1/chat/completions" in error["message"]
    error = assert_error(emb_there, 400, "model", "wrong_model_kind")
    assert "an embedding model" in error["message"]
    assert_error(tokenize, 400, "model", "wrong_model_kind")
    assert chat.status_code == 200, chat.text
    assert embedded.status_code == 200, embedded.text
    assert [(card["id"], card["kind"]) for card in listing] == [
        ("chat", "chat"),
        (MODEL, "embedding"),
    ]
    assert "formats" in listing[0]
    assert "formats" not in listing[1]
    assert health["models"][MODEL]["loaded"] is True


@pytest.mark.slow
async def test_an_embedding_model_loads_on_first_use_and_unloads_when_idle(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding(
        load_on_first_use=True, idle_unload_timeout=0.3
    ) as served:
        slot = served.app.state.models.get(MODEL).slot
        assert slot.engine is None
        first = await embed(served, input="cat")
        assert slot.loads == 1
        with anyio.fail_after(20):
            await until(lambda: slot.engine is None)
        again = await embed(served, input="cat")
    assert vectors(first) == vectors(again)
    assert (slot.loads, slot.unloads) == (2, 1)


@pytest.mark.slow
async def test_an_embedding_model_counts_in_the_memory_budget(
    serve_embedding: ServeEmbedding, tiny_model_path: Path
) -> None:
    async with serve_embedding(
        model=[tiny_model_path, tiny_embedding_path()],
        served_model_name=("chat", MODEL),
        model_kind="chat",
        model_settings=({}, {"model_kind": "embedding", "load_on_first_use": True}),
    ) as served:
        before = served.app.state.residency.weight_bytes()
        assert (await embed(served, input="cat")).status_code == 200
        after = served.app.state.residency.weight_bytes()
    assert after - before == engine_of_bytes(tiny_embedding_path())


def engine_of_bytes(folder: Path) -> int:
    """Bytes of the tiny model's float32 weights, from its file's header."""
    raw = (folder / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    return sum(
        end - start
        for key, item in header.items()
        if key != "__metadata__"
        for start, end in [item["data_offsets"]]
    )


@pytest.mark.slow
async def test_a_cancelled_request_leaves_nothing_in_the_queue(
    serve_embedding: ServeEmbedding,
) -> None:
    async with serve_embedding() as served:
        engine = engine_of(served)
        texts = [f"{TEXTS[0]} {i}" for i in range(2000)]
        with anyio.move_on_after(0.05):
            await engine.embed(EmbeddingParams(tuple(texts)))
        waiting = engine.counters().rows
        answer = await embed(served, input="cat")
    assert waiting == 0
    assert answer.status_code == 200


@pytest.mark.slow
async def test_a_failed_pass_fails_its_requests_and_not_the_next(
    serve_embedding: ServeEmbedding, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve_embedding() as served:
        loop = engine_of(served).loop
        forward = loop.forward

        def broken(batch: Any) -> Any:
            raise RuntimeError("the model broke")

        monkeypatch.setattr(loop, "forward", broken)
        failed = await embed(served, input="cat")
        monkeypatch.setattr(loop, "forward", forward)
        fine = await embed(served, input="cat")
    assert failed.status_code == 500
    assert "the model broke" not in failed.text
    assert fine.status_code == 200


@pytest.mark.slow
def test_the_sdk_embeds_through_a_served_config_file(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    import sys

    from .kit import running

    config = tmp_path / "models.toml"
    config.write_text(
        f'[[models]]\npath = "{tiny_model_path}"\nname = "chat"\n\n'
        f'[[models]]\npath = "{tiny_embedding_path()}"\nname = "{MODEL}"\n'
        'model_kind = "embedding"\nload_on_first_use = true\n'
    )
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += ["--config", str(config), "--port", "0"]
    with running(command, tmp_path / "log") as server:
        client = server.client()
        answer = client.embeddings.create(model=MODEL, input=["cat", "dog"])
        listed = {m.id: cast(Any, m).kind for m in client.models.list()}
    assert len(answer.data) == 2
    assert len(answer.data[0].embedding) == 64
    assert listed == {"chat": "chat", MODEL: "embedding"}


@pytest.mark.slow
async def test_a_large_request_never_stalls_a_chat_stream_for_long(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 0.05  # the embedding model's prefill_step_seconds: a pass's time
    texts = [f"{TEXTS[i % 4]} {i}" for i in range(1500)]
    app = create_app(
        [tiny_model_path, tiny_embedding_path()],
        served_model_name=("chat", MODEL),
        model_settings=(
            {},
            {"model_kind": "embedding", "prefill_step_seconds": budget},
        ),
        stream_write_interval=0.0,
    )
    with run_uvicorn(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            beside = await chat_beside(
                app,
                client,
                lambda c: c.post(
                    "/v1/embeddings", json={"model": MODEL, "input": texts}
                ),
                monkeypatch,
                max_tokens=600,
            )
    # The request takes many passes, and a step of the chat model runs
    # between each two of them: the stream never waits for the whole request.
    assert beside.last - beside.first > 10
    assert beside.stalls == []


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(SettingError, match="model_kind must be one of chat"):
        ServerConfig(model="m", model_kind="vision")


def test_a_chat_setting_of_an_embedding_model_is_refused() -> None:
    with pytest.raises(
        SettingError, match="'emb': kv_bits is not a setting of an embedding model"
    ):
        ServerConfig(
            model=("chat", "e"),
            served_model_name=("chat", "emb"),
            model_settings=({}, {"model_kind": "embedding", "kv_bits": 8}),
        )


def test_the_servers_chat_settings_skip_an_embedding_model() -> None:
    config = ServerConfig(
        model=("chat", "e"),
        model_settings=({}, {"model_kind": "embedding"}),
        kv_bits=8,
        prompt_lookup_tokens=2,
        tool_call_parser="hermes",
    )
    chat, embedding = config.for_model(0), config.for_model(1)
    assert (chat.kv_bits, chat.prompt_lookup_tokens) == (8, 2)
    assert chat.tool_call_parser == "hermes"
    assert (embedding.kv_bits, embedding.prompt_lookup_tokens) == (None, 0)
    assert embedding.tool_call_parser is None
