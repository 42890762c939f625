"""The error edge: every refusal outside an endpoint in its route's shape."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.testclient import TestClient

from mlx_pinned import MLXThreadBusyError
from mlx_pinned.server.app import create_app
from mlx_pinned.server.http.routes import ErrorEdge

from .kit import Server, running

MESSAGE = {"role": "user", "content": "Hi"}
ANTHROPIC_BODY = {"model": "tiny", "max_tokens": 4, "messages": [MESSAGE]}
OPENAI_BODY = {"model": "tiny", "max_tokens": 4, "messages": [MESSAGE]}


def anthropic_shape(body: Any, kind: str) -> None:
    assert set(body) == {"type", "error"}
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    assert body["error"]["message"]


def openai_shape(body: Any, kind: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind


@pytest.fixture(scope="module")
def keyed(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> Iterator[Server]:
    """A real server with ``--api-key secret``."""
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += [str(tiny_model_path), "--served-model-name", "tiny"]
    command += ["--port", "0", "--api-key", "secret"]
    with running(command, tmp_path_factory.mktemp("keyed") / "log") as served:
        yield served


class TestAPIKey:
    def test_anthropic_sdk_gets_an_authentication_error(self, keyed: Server) -> None:
        client = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
        with client, pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(**ANTHROPIC_BODY)
        assert info.value.status_code == 401
        anthropic_shape(info.value.body, "authentication_error")

    def test_openai_sdk_gets_an_authentication_error(self, keyed: Server) -> None:
        client = openai.OpenAI(
            base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0
        )
        with client, pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(**OPENAI_BODY)
        assert info.value.status_code == 401
        assert info.value.code == "invalid_api_key"
        # The SDK keeps the body's "error" object.
        assert info.value.body == {
            "message": info.value.body["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }

    def test_a_missing_key_is_answered_in_each_apis_shape(self, keyed: Server) -> None:
        messages = httpx.post(f"{keyed.url}/v1/messages", json=ANTHROPIC_BODY)
        assert messages.status_code == 401
        anthropic_shape(messages.json(), "authentication_error")
        chat = httpx.post(f"{keyed.url}/v1/chat/completions", json=OPENAI_BODY)
        assert chat.status_code == 401
        openai_shape(chat.json(), "invalid_request_error")

    def test_the_right_key_is_served_by_both_sdks(self, keyed: Server) -> None:
        claude = anthropic.Anthropic(
            base_url=keyed.url, api_key="secret", max_retries=0
        )
        with claude:
            assert claude.messages.create(**ANTHROPIC_BODY).type == "message"
        gpt = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="secret", max_retries=0)
        with gpt:
            chat = gpt.chat.completions.create(**OPENAI_BODY)
        assert chat.object == "chat.completion"


class TestEdge:
    @pytest.fixture
    def edge(self, tiny_model_path: Path) -> ErrorEdge:
        errors: ErrorEdge = create_app(tiny_model_path).state.errors
        return errors

    def test_the_middlewares_refusal_is_in_the_routes_shape(
        self, edge: ErrorEdge
    ) -> None:
        busy = MLXThreadBusyError("The MLX thread is busy.")
        client = TestClient(edge.refusal(busy))
        messages = client.post("/v1/messages")
        assert messages.status_code == 529  # Anthropic's "overloaded, retry"
        assert messages.headers["retry-after"] == "1"
        anthropic_shape(messages.json(), "overloaded_error")
        chat = client.post("/v1/chat/completions")
        assert chat.status_code == 503
        openai_shape(chat.json(), "server_error")
        assert chat.json()["error"]["code"] == "server_busy"

    def test_routes_of_no_api_answer_in_openais_shape(self, edge: ErrorEdge) -> None:
        for path in ("/health", "/v1/models", "/nowhere"):
            assert edge.shape(path) is edge.shape("/v1/chat/completions")
        assert edge.shape("/v1/messages/count_tokens") is edge.shape("/v1/messages")
        assert edge.shape("/v1/messages") is not edge.shape("/v1/chat/completions")

    def test_the_handlers_answer_in_the_routes_shape(
        self, tiny_model_path: Path
    ) -> None:
        # No lifespan: a wrong method never reaches a model.
        client = TestClient(create_app(tiny_model_path))
        messages = client.get("/v1/messages")
        assert messages.status_code == 405
        assert messages.headers["allow"] == "POST"
        anthropic_shape(messages.json(), "invalid_request_error")
        chat = client.get("/v1/chat/completions")
        assert chat.status_code == 405
        openai_shape(chat.json(), "invalid_request_error")
