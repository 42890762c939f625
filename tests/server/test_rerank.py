"""``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``): the Cohere/Jina
shape that vLLM serves, scores of shared passes that equal each pair alone,
documents cut to the model's positions, hostile inputs (never a 5xx), and
rerank models as models of the one registry."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.server.kinds.rerank.engine import RerankEngine
from mlx_pinned.testing import tiny_embedding_path, tiny_lm_path, tiny_reranker_path

from .conftest import assert_error
from .kit import TOL, Lifespan, Served, in_process

pytestmark = pytest.mark.anyio

MODEL = "rr"
QUERY = "Is there a cat on the table?"
DOCUMENTS = (
    "There is a cat on the table next to a cup of tea.",
    "The weather today is sunny with a light breeze from the sea.",
    "A small red square sits on a blue background.",
    "cat",
    "Green trees, white clouds, yellow sun and a grey road.",
)

ServeRerank = Callable[..., AbstractAsyncContextManager[Served]]


@pytest.fixture
def serve_rerank(lifespan: Lifespan) -> ServeRerank:
    """An app serving the tiny reranker as ``rr`` (and whatever else a test
    names), its lifespan running."""

    @asynccontextmanager
    async def serve(**options: Any) -> AsyncIterator[Served]:
        options.setdefault("served_model_name", MODEL)
        options.setdefault("model_kind", "rerank")
        app = create_app(options.pop("model", tiny_reranker_path()), **options)
        async with in_process(app, lifespan, Served) as served:
            yield served

    return serve


def engine_of(served: Served) -> RerankEngine:
    engine = served.app.state.models.get(MODEL).engine()
    assert isinstance(engine, RerankEngine)
    return engine


async def rerank(served: Served, path: str = "/v1/rerank", **body: Any) -> Any:
    body.setdefault("model", MODEL)
    body.setdefault("query", QUERY)
    return await served.client.post(path, json=body)


def scores_by_index(response: httpx.Response) -> dict[int, float]:
    assert response.status_code == 200, response.text
    return {r["index"]: r["relevance_score"] for r in response.json()["results"]}


async def test_documents_come_back_ranked_with_their_scores(
    serve_rerank: ServeRerank,
) -> None:
    async with serve_rerank() as served:
        answer = await rerank(served, documents=list(DOCUMENTS))
        tokenizer = engine_of(served).loaded.tokenizer
        pairs = tokenizer([QUERY] * len(DOCUMENTS), list(DOCUMENTS))["input_ids"]
    body = answer.json()
    assert answer.status_code == 200, answer.text
    assert body["id"].startswith("rerank-")
    assert body["model"] == MODEL
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 < score < 1.0 for score in scores)
    assert all("document" not in r for r in results)
    tokens = sum(len(ids) for ids in pairs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


@pytest.mark.slow
async def test_top_n_and_return_documents_and_the_aliases(
    serve_rerank: ServeRerank,
) -> None:
    async with serve_rerank() as served:
        full = await rerank(served, documents=list(DOCUMENTS))
        objects = [{"text": text} for text in DOCUMENTS]
        answers = [
            await rerank(
                served, path, documents=objects, top_n=2, return_documents=True
            )
            for path in ("/v1/rerank", "/rerank", "/v2/rerank")
        ]
        too_many = await rerank(served, documents=list(DOCUMENTS), top_n=50)
    best = full.json()["results"][:2]
    for answer in answers:
        results = answer.json()["results"]
        assert [r["index"] for r in results] == [r["index"] for r in best]
        assert [r["document"]["text"] for r in results] == [
            DOCUMENTS[r["index"]] for r in best
        ]
    assert len(too_many.json()["results"]) == len(DOCUMENTS)


@pytest.mark.slow
async def test_a_batch_of_pairs_equals_each_pair_alone(
    serve_rerank: ServeRerank,
) -> None:
    async with serve_rerank(max_num_seqs=8) as served:
        together = scores_by_index(await rerank(served, documents=list(DOCUMENTS)))
        alone = [
            scores_by_index(await rerank(served, documents=[text]))[0]
            for text in DOCUMENTS
        ]
        engine = engine_of(served)
        before = engine.loop.passes
        answers: list[dict[int, float]] = [{} for _ in range(8)]

        async def one(index: int) -> None:
            answers[index] = scores_by_index(
                await rerank(served, documents=list(DOCUMENTS))
            )

        async with anyio.create_task_group() as tasks:
            for index in range(8):
                tasks.start_soon(one, index)
        passes = engine.loop.passes - before
    for index, score in enumerate(alone):
        assert abs(together[index] - score) <= TOL
        for answer in answers:
            assert abs(answer[index] - score) <= TOL
    assert passes < 8, "concurrent requests shared no pass"


@pytest.mark.slow
async def test_a_long_document_is_cut_and_a_long_query_refused(
    serve_rerank: ServeRerank,
) -> None:
    async with serve_rerank() as served:
        long = await rerank(served, documents=["cat " * 400, "cat"])
        refused = await rerank(served, query="cat " * 400, documents=["cat"])
        short = len(engine_of(served).loaded.tokenizer(QUERY, "cat")["input_ids"])
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["prompt_tokens"] == 128 + short  # cut to fit
    error = assert_error(refused, 400, "query", "context_length_exceeded")
    assert "128" in error["message"]


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("no documents", {"documents": []}, "documents"),
    ("an empty document", {"documents": ["a", ""]}, "documents"),
    ("too many documents", {"documents": ["a"] * 1001}, "documents"),
    ("10,000 documents", {"documents": ["a"] * 10_000}, "documents"),
    ("a number as a document", {"documents": [5]}, "documents"),
    ("an object without text", {"documents": [{"title": "a"}]}, "documents"),
    ("documents as a string", {"documents": "a"}, "documents"),
    ("an empty query", {"query": "", "documents": ["a"]}, "query"),
    ("a query that is a list", {"query": ["a"], "documents": ["a"]}, "query"),
    ("top_n of 0", {"documents": ["a"], "top_n": 0}, "top_n"),
    ("top_n as text", {"documents": ["a"], "top_n": "2"}, "top_n"),
    ("return_documents as text", {"documents": ["a"], "return_documents": "y"}, ""),
    ("an unknown field", {"documents": ["a"], "max_chunks_per_doc": 2}, ""),
]


@pytest.mark.parametrize(
    ("body", "param"), [pytest.param(b, p, id=name) for name, b, p in HOSTILE]
)
async def test_hostile_bodies_are_a_400_that_names_the_field(
    serve_rerank: ServeRerank, body: dict[str, Any], param: str
) -> None:
    async with serve_rerank() as served:
        answer = await rerank(served, **body)
        after = await rerank(served, documents=["cat"])
    assert answer.status_code == 400, answer.text
    named = answer.json()["error"]["param"]
    expected = param or next(key for key in body if key != "documents")
    assert named == expected or named.startswith(f"{expected}["), named
    assert after.status_code == 200


@pytest.mark.slow
async def test_each_kind_is_sent_to_its_own_route(serve_rerank: ServeRerank) -> None:
    async with serve_rerank(
        model=[tiny_reranker_path(), tiny_embedding_path()],
        served_model_name=(MODEL, "emb"),
        model_kind="chat",
        model_settings=({"model_kind": "rerank"}, {"model_kind": "embedding"}),
    ) as served:
        here = await served.client.post(
            "/v1/embeddings", json={"model": MODEL, "input": "cat"}
        )
        there = await rerank(served, model="emb", documents=["cat"])
        embedded = await served.client.post(
            "/v1/embeddings", json={"model": "emb", "input": "cat"}
        )
        ranked = await rerank(served, documents=["cat"])
        listing = (await served.client.get("/v1/models")).json()["data"]
    assert (
        "/v1/rerank" in assert_error(here, 400, "model", "wrong_model_kind")["message"]
    )
    assert_error(there, 400, "model", "wrong_model_kind")
    assert embedded.status_code == ranked.status_code == 200
    assert [card["kind"] for card in listing] == ["rerank", "embedding"]


@pytest.mark.slow
async def test_a_generative_reranker_fails_its_load_with_the_reason(
    serve_rerank: ServeRerank, caplog: pytest.LogCaptureFixture
) -> None:
    path: Path = tiny_lm_path()
    async with serve_rerank(model=path, load_on_first_use=True) as served:
        answer = await rerank(served, documents=["cat"])
    assert_error(answer, 503, None, "model_load_failed")
    assert "generative reranker" in caplog.text


@pytest.mark.slow
async def test_many_documents_are_scored_each_as_alone(
    serve_rerank: ServeRerank,
) -> None:
    documents = [DOCUMENTS[i % len(DOCUMENTS)] for i in range(600)]
    async with serve_rerank() as served:
        many = scores_by_index(await rerank(served, documents=documents))
        alone = scores_by_index(await rerank(served, documents=list(DOCUMENTS)))
    assert sorted(many) == list(range(600))
    for index, score in many.items():
        assert abs(score - alone[index % len(DOCUMENTS)]) <= TOL
