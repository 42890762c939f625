"""A text-only model served over HTTP: text answers, images refused by name."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.testing import tiny_lm_path

from .conftest import assert_error, vision_body
from .openapi import CheckedTransport

pytestmark = pytest.mark.anyio


async def test_text_model_answers_text_and_refuses_images(lifespan: Any) -> None:
    app = create_app(tiny_lm_path("qwen3"), served_model_name="tiny", max_num_seqs=4)
    transport = CheckedTransport(httpx.ASGITransport(app=app))
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        text = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": 5,
            "temperature": 0.0,
        }
        answer = await client.post("/v1/chat/completions", json=text)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 5
        before = app.state.mlx_thread.statistics().completed
        refused = await client.post(
            "/v1/chat/completions", json=vision_body(4, model="tiny")
        )
        error = assert_error(
            refused, 400, "messages[0].content[1].image_url", "images_unsupported"
        )
        assert "takes no images" in error["message"]
        # Refused before any image was decoded or anything ran on the thread.
        assert app.state.mlx_thread.statistics().completed == before
