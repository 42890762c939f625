"""``POST /v1/embeddings`` with images: vLLM's ``messages`` shape (a
conversation of text and ``image_url`` parts, one vector) and ``image_url``
parts among ``input`` (each its own vector, as mlx-vlm's server takes them),
on the tiny Qwen3-VL-Embedding. The vector equals mlx-vlm's own image-embedding path
(its server's ``_embed_image``, called on the MLX thread), a request alone
equals the same request beside others, and hostile images are 400s that
name the part.

The openai SDK's ``embeddings.create`` requires ``input``, so it cannot send
a body of ``messages`` alone (``input`` and ``messages`` together are a
400): those requests go through httpx; the SDK embeds text on the same
model.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.server.config import ImageLimits
from mlx_pinned.server.http.errors import APIError
from mlx_pinned.server.kinds.embedding.engine import EmbeddingEngine
from mlx_pinned.server.kinds.embedding.protocol import parse_embedding_request
from mlx_pinned.server.kinds.embedding.values import ImageInput
from mlx_pinned.testing import image_data_uri, tiny_embedding_path

from .conftest import assert_error
from .kit import TOL, Lifespan, Serve, Served, in_process, slow_on_asyncio

pytestmark = pytest.mark.anyio

MODEL = "vl-emb"
TEXT_MODEL = "emb"
IMAGE = image_data_uri(64, 64, "PNG", seed=1)
OTHER = image_data_uri(96, 64, "JPEG", seed=2)


@pytest.fixture(scope="session")
def vl_path() -> Path:
    return tiny_embedding_path("qwen3_vl_embedding")


@pytest.fixture
def serve(vl_path: Path, lifespan: Lifespan) -> Serve:
    """An app serving the tiny Qwen3-VL-Embedding as ``vl-emb`` (and the
    tiny BERT as ``emb``, a text-only one), its lifespan running."""

    @asynccontextmanager
    async def serve(**options: Any) -> AsyncIterator[Served]:
        app = create_app(
            [vl_path, tiny_embedding_path()],
            served_model_name=(MODEL, TEXT_MODEL),
            model_kind="embedding",
            **options,
        )
        async with in_process(app, lifespan, Served) as served:
            yield served

    return serve


def engine_of(served: Served, name: str = MODEL) -> EmbeddingEngine:
    engine = served.app.state.models.get(name).engine()
    assert isinstance(engine, EmbeddingEngine)
    return engine


def image_turn(url: str = IMAGE, text: str | None = None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}]
    if text is not None:
        parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


async def embed(served: Served, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    return await served.client.post("/v1/embeddings", json=body)


def vector(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert len(data) == 1
    return np.array(data[0]["embedding"])


def refused(body: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_embedding_request(body)
    return caught.value


def test_input_and_messages_together_are_a_400_that_names_messages() -> None:
    both = (
        b'{"model": "m", "input": "cat",'
        b' "messages": [{"role": "user", "content": "x"}]}'
    )
    error = refused(both)
    assert (error.status, error.param) == (400, "messages")
    assert "not both" in error.message


def test_neither_input_nor_messages_is_a_400_that_names_input() -> None:
    error = refused(b'{"model": "m"}')
    assert (error.status, error.param, error.code) == (
        400,
        "input",
        "missing_required_parameter",
    )


def test_a_generation_prompt_without_messages_is_refused_by_name() -> None:
    error = refused(b'{"model": "m", "input": "cat", "add_generation_prompt": true}')
    assert error.param == "add_generation_prompt"


def test_an_image_as_a_data_uri_string_in_input_is_refused() -> None:
    """By OpenAI's definition a text; never meant as one."""
    error = refused(b'{"model": "m", "input": ["cat", "data:image/png;base64,AA"]}')
    assert error.param == "input"
    assert "image_url" in error.message


def test_a_video_part_in_messages_is_refused_by_name() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content":'
        b' [{"type": "video_url", "video_url": {"url": "x"}}]}]}'
    )
    error = refused(body)
    assert error.status == 400
    assert error.param is not None
    assert error.param.startswith("messages[0].content[0]")


def test_images_in_input_are_numbered_in_order() -> None:
    part = b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}'
    request = parse_embedding_request(
        b'{"model": "m", "input": [' + part + b', "cat", ' + part + b"]}"
    )
    params = request.to_embedding_params()
    assert params.inputs == (ImageInput(0), "cat", ImageInput(1))
    assert [where for where, _ in request.image_parts()] == [
        "input[0].image_url",
        "input[2].image_url",
    ]


def test_image_parts_are_named_where_they_are_and_marked_in_place() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "system", "content": "be brief"},'
        b'{"role": "user", "content": [{"type": "text", "text": "a"},'
        b'{"type": "image_url", "image_url": "data:image/png;base64,AA"}]}]}'
    )
    request = parse_embedding_request(body)
    assert request.image_parts() == [
        ("messages[1].content[1].image_url", "data:image/png;base64,AA")
    ]
    params = request.to_embedding_params()
    assert params.inputs == ()
    assert params.messages[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
    ]


@slow_on_asyncio
async def test_an_image_embeds_as_mlx_vlms_own_image_path(serve: Serve) -> None:
    """mlx-vlm's server embeds an image as one user turn holding it, its
    generation prompt added: the same request here gives the same vector."""
    embeddings = importlib.import_module("mlx_vlm.server.embeddings")
    async with serve() as served:
        answer = await embed(served, messages=image_turn(), add_generation_prompt=True)
        loaded = engine_of(served).loaded
        theirs, tokens = await engine_of(served).thread.run(
            embeddings._embed_image, loaded.model, loaded.processor, IMAGE
        )
    ours = vector(answer)
    assert len(ours) == 64
    assert np.linalg.norm(ours) == pytest.approx(1.0, abs=1e-5)
    assert np.abs(ours - np.array(theirs)).max() <= TOL
    assert answer.json()["usage"]["prompt_tokens"] == tokens


@slow_on_asyncio
async def test_images_in_input_are_each_their_own_vector(serve: Serve) -> None:
    """Each image in ``input`` is the vector of a one-image turn with its
    generation prompt (mlx-vlm's server's), texts beside it their own."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in (IMAGE, OTHER)]
    async with serve() as served:
        mixed = await embed(served, input=[parts[0], "a red fox", parts[1]])
        turn = await embed(served, messages=image_turn(), add_generation_prompt=True)
        other = await embed(
            served, messages=image_turn(OTHER), add_generation_prompt=True
        )
        text = await embed(served, input="a red fox")
    assert mixed.status_code == 200, mixed.text
    got = [np.array(item["embedding"]) for item in mixed.json()["data"]]
    for row, alone in zip(got, (turn, text, other), strict=True):
        assert np.abs(row - vector(alone)).max() <= TOL
    usage = [r.json()["usage"]["prompt_tokens"] for r in (turn, text, other)]
    assert mixed.json()["usage"]["prompt_tokens"] == sum(usage)


@slow_on_asyncio
async def test_a_conversation_alone_equals_it_beside_other_requests(
    serve: Serve,
) -> None:
    """The same image gives the same vector every time, and beside other
    image and text requests (the model keeps positions between calls)."""
    conversations = [
        image_turn(IMAGE),
        image_turn(OTHER, "a photo"),
        [{"role": "user", "content": "no image at all"}],
        image_turn(IMAGE, "the same image, with text"),
    ]
    async with serve() as served:
        alone = [vector(await embed(served, messages=turns)) for turns in conversations]
        again = vector(await embed(served, messages=conversations[0]))
        beside: list[np.ndarray] = [np.zeros(0)] * len(conversations)

        async def one(index: int) -> None:
            beside[index] = vector(await embed(served, messages=conversations[index]))

        async def texts() -> None:
            answer = await embed(served, input=["cat", "a longer text " * 8])
            assert answer.status_code == 200, answer.text

        async with anyio.create_task_group() as group:
            for index in range(len(conversations)):
                group.start_soon(one, index)
                group.start_soon(texts)
    assert np.array_equal(again, alone[0])
    for got, expected in zip(beside, alone, strict=True):
        assert np.abs(got - expected).max() <= TOL
    assert np.abs(alone[0] - alone[1]).max() > 1e-3  # different images differ


@slow_on_asyncio
async def test_text_input_beside_images_equals_it_alone(serve: Serve) -> None:
    """A text pass after an image conversation is not moved by it: the
    Qwen-VL model would reuse the image's positions for any shorter input,
    and this text runs past where the image starts."""
    text = "a red fox and a dog"
    async with serve() as served:
        sdk = served.sdk()
        first = await sdk.embeddings.create(model=MODEL, input=text)
        image = await embed(served, messages=image_turn())
        after = await sdk.embeddings.create(model=MODEL, input=text)
    assert image.status_code == 200, image.text
    assert (
        np.abs(
            np.array(first.data[0].embedding) - np.array(after.data[0].embedding)
        ).max()
        <= TOL
    )


HOSTILE = [
    ("bad base64", image_turn("data:image/png;base64,!!!notbase64"), "invalid"),
    ("not an image", image_turn("data:image/png;base64,aGVsbG8="), "invalid"),
    ("a local path", image_turn("/etc/passwd"), "invalid_image_url"),
    ("a file URL", image_turn("file:///etc/passwd"), "invalid_image_url"),
]


@slow_on_asyncio
@pytest.mark.parametrize(
    ("turns", "code"), [pytest.param(t, c, id=name) for name, t, c in HOSTILE]
)
async def test_a_hostile_image_is_a_400_that_names_its_part(
    serve: Serve, turns: list[dict[str, Any]], code: str
) -> None:
    async with serve() as served:
        answer = await embed(served, messages=turns)
        after = await embed(served, messages=image_turn())
    error = assert_error(answer, 400, "messages[0].content[0].image_url")
    assert error["code"].startswith(code), error
    assert after.status_code == 200  # the server is fine


@slow_on_asyncio
async def test_too_many_images_are_a_400(serve: Serve) -> None:
    parts = [{"type": "image_url", "image_url": {"url": IMAGE}}] * 3
    async with serve(image_limits=ImageLimits(max_images=2)) as served:
        answer = await embed(served, messages=[{"role": "user", "content": parts}])
        listed = await embed(served, input=parts)
    assert_error(answer, 400, "messages[0].content[2].image_url")
    assert_error(listed, 400, "input[2].image_url")


@slow_on_asyncio
async def test_a_bad_image_in_input_is_named_by_its_index(serve: Serve) -> None:
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}
    async with serve() as served:
        answer = await embed(served, input=["cat", bad])
        text_model = await embed(served, model=TEXT_MODEL, input=["cat", bad])
    assert_error(answer, 400, "input[1].image_url")
    assert_error(text_model, 400, "input[1].image_url", "images_unsupported")


@slow_on_asyncio
async def test_a_text_only_model_refuses_images_and_conversations(
    serve: Serve,
) -> None:
    """The tiny BERT has no image processor and no chat template."""
    async with serve() as served:
        image = await embed(served, model=TEXT_MODEL, messages=image_turn())
        text = await embed(
            served, model=TEXT_MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert_error(image, 400, "messages[0].content[0].image_url", "images_unsupported")
    assert_error(text, 400, "messages")
