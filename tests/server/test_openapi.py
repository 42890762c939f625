"""The test clients' check against OpenAI's OpenAPI document
(``tests/server/openapi.py``): which schema each answer is read as, that a
body or an event of another shape fails where it is read and is recorded,
and that each documented exception widens only its own place."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .openapi import (
    MISMATCHES,
    SPEC,
    CheckedTransport,
    ShapeMismatch,
    check_body,
    check_event,
    schema_of,
)


@pytest.fixture
def mismatches() -> Iterator[list[str]]:
    """The mismatches a test makes on purpose, taken off the record that
    would fail it."""
    found: list[str] = []
    yield found
    found += MISMATCHES
    MISMATCHES.clear()


def raw(value: Any) -> bytes:
    return json.dumps(value).encode()


def chat(**fields: Any) -> dict[str, Any]:
    message = {"role": "assistant", "content": "hi", "refusal": None}
    choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }
    return {**body, **fields}


class TestTheSchemaOfEachAnswer:
    def test_the_document_is_read_from_beside_the_repository(self) -> None:
        assert SPEC.is_file()
        assert (SPEC.parent / "openai-openapi.SOURCE").is_file()

    @pytest.mark.parametrize(
        ("method", "path", "status", "media", "name"),
        [
            (
                "POST",
                "/v1/chat/completions",
                200,
                "application/json",
                "CreateChatCompletionResponse",
            ),
            (
                "POST",
                "/v1/chat/completions",
                200,
                "text/event-stream",
                "CreateChatCompletionStreamResponse",
            ),
            ("POST", "/v1/completions", 200, "text/event-stream", "CompletionChunk"),
            ("POST", "/v1/responses", 200, "text/event-stream", "ResponseStreamEvent"),
            ("GET", "/v1/responses/resp_1", 200, "application/json", "Response"),
            (
                "GET",
                "/v1/responses/resp_1/input_items",
                200,
                "application/json",
                "ResponseItemList",
            ),
            ("POST", "/v1/embeddings", 400, "application/json", "ErrorResponse"),
            ("GET", "/v1/models", 200, "application/json", "ListModelsResponse"),
            ("POST", "/v1/rerank", 200, "application/json", None),
            ("POST", "/v1/messages", 200, "application/json", None),
            ("GET", "/health", 200, "application/json", None),
            ("DELETE", "/v1/responses/resp_1", 200, "application/json", None),
        ],
    )
    def test_by_method_path_status_and_media(
        self, method: str, path: str, status: int, media: str, name: str | None
    ) -> None:
        assert schema_of(method, path, status, media) == name


class TestTheCheck:
    def test_a_body_of_the_schema_passes(self) -> None:
        check_body("CreateChatCompletionResponse", raw(chat()), "x")

    def test_a_body_of_another_shape_fails_and_is_recorded(
        self, mismatches: list[str]
    ) -> None:
        body = raw(chat(created="yesterday"))
        with pytest.raises(ShapeMismatch, match=r"\['created'\]"):
            check_body(
                "CreateChatCompletionResponse", body, "POST /v1/chat/completions"
            )
        assert len(MISMATCHES) == 1

    def test_an_event_is_checked_against_the_member_of_its_type(
        self, mismatches: list[str]
    ) -> None:
        delta = {"type": "response.output_text.delta", "sequence_number": 1}
        with pytest.raises(ShapeMismatch, match="ResponseTextDeltaEvent"):
            check_event("ResponseStreamEvent", raw(delta).decode(), "x")

    def test_done_and_an_error_chunk_are_a_streams_own(
        self, mismatches: list[str]
    ) -> None:
        check_event("CreateChatCompletionStreamResponse", "[DONE]", "x")
        error = {"message": "m", "type": "server_error", "param": None, "code": None}
        chunk = raw({"error": error}).decode()
        check_event("CreateChatCompletionStreamResponse", chunk, "x")
        bad = raw({"error": {"message": "m"}}).decode()
        with pytest.raises(ShapeMismatch, match="ErrorResponse"):
            check_event("CreateChatCompletionStreamResponse", bad, "x")

    def test_each_exception_widens_only_its_own_place(
        self, mismatches: list[str]
    ) -> None:
        null = raw(chat(system_fingerprint=None))
        check_body("CreateChatCompletionResponse", null, "x")
        number = raw(chat(system_fingerprint=5))
        with pytest.raises(ShapeMismatch, match="system_fingerprint"):
            check_body("CreateChatCompletionResponse", number, "x")
        cut = {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "text": "a", "finish_reason": None, "logprobs": None}
            ],
        }
        check_event("CompletionChunk", raw(cut).decode(), "x")
        with pytest.raises(ShapeMismatch, match="finish_reason"):
            check_body("CreateCompletionResponse", raw(cut), "x")


def _app(body: bytes, media: str, status: int = 200) -> Starlette:
    async def answer(request: Request) -> Response:
        if media == "text/event-stream":

            async def chunks() -> AsyncIterator[bytes]:
                for line in body.split(b"\n\n"):
                    yield line + b"\n\n"

            return StreamingResponse(chunks(), media_type=media, status_code=status)
        return Response(body, media_type=media, status_code=status)

    async def other(request: Request) -> Response:
        return JSONResponse({"anything": True})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", answer, methods=["POST"]),
            Route("/v1/rerank", other, methods=["POST"]),
        ]
    )


@pytest.mark.anyio
class TestTheTransport:
    async def post(self, app: Starlette, path: str = "/v1/chat/completions") -> str:
        transport = CheckedTransport(httpx.ASGITransport(app=app))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t"
        ) as client:
            answer = await client.post(path, json={})
            return answer.text

    async def test_a_whole_body_is_checked_as_it_is_read(
        self, mismatches: list[str]
    ) -> None:
        app = _app(b'{"object": "chat.completion"}', "application/json")
        with pytest.raises(
            ShapeMismatch, match="is not a CreateChatCompletionResponse"
        ):
            await self.post(app)

    async def test_each_event_of_a_stream_is_checked(
        self, mismatches: list[str]
    ) -> None:
        events = b'data: {"object": "chat.completion.chunk"}\n\ndata: [DONE]'
        app = _app(events, "text/event-stream")
        with pytest.raises(ShapeMismatch, match="an event of POST"):
            await self.post(app)

    async def test_an_error_must_be_openais_error_body(
        self, mismatches: list[str]
    ) -> None:
        app = _app(b"Internal Server Error", "text/plain", status=500)
        with pytest.raises(ShapeMismatch, match="is not JSON"):
            await self.post(app)

    async def test_a_path_openai_does_not_define_is_not_checked(self) -> None:
        assert "anything" in await self.post(_app(b"", "text/plain"), "/v1/rerank")
