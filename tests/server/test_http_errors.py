"""The OpenAI-shaped routes' one error table: each failure, its answer."""

from __future__ import annotations

import pytest

from mlx_pinned import MLXThreadBusyError
from mlx_pinned.server.failures import (
    ImageRefusedError,
    ImagesUnsupportedError,
    InvalidGrammarError,
    OverloadedError,
    PromptTooLongError,
    UnavailableError,
)
from mlx_pinned.server.http.errors import api_error

IMAGES = ["messages[0].content[1].image_url", "messages[2].content[0].image_url"]


class TestTable:
    @pytest.mark.parametrize(
        ("failure", "status", "param", "code"),
        [
            (
                PromptTooLongError("long.", 9, 8),
                400,
                "messages",
                "context_length_exceeded",
            ),
            (ImagesUnsupportedError(), 400, "messages", "images_unsupported"),
            (InvalidGrammarError("bad."), 400, None, "invalid_grammar"),
            (
                ImageRefusedError("big.", index=1, code="image_too_large"),
                400,
                IMAGES[1],
                "image_too_large",
            ),
            (OverloadedError(3, retry_after=7), 503, None, "server_busy"),
        ],
    )
    def test_each_failure_has_one_answer(
        self, failure: Exception, status: int, param: str | None, code: str
    ) -> None:
        answer = api_error(failure, retry_after=1, places=IMAGES)
        assert answer is not None
        assert (answer.status, answer.param, answer.code) == (status, param, code)
        assert str(failure) in answer.message

    def test_a_refused_image_is_named_where_the_request_holds_it(self) -> None:
        failure = ImageRefusedError("not a PNG.", index=0, code="invalid_image")
        answer = api_error(failure, retry_after=1, places=IMAGES)
        assert answer is not None
        assert answer.message == f"Invalid image at '{IMAGES[0]}': not a PNG."

    def test_the_prompt_is_named_as_the_api_names_it(self) -> None:
        failure = PromptTooLongError("long.", 9, 8)
        answer = api_error(failure, retry_after=1, prompt="prompt")
        assert answer is not None
        assert answer.param == "prompt"

    def test_a_refused_image_the_edge_cannot_place_names_the_messages(self) -> None:
        failure = ImageRefusedError("not a PNG.", index=5, code="invalid_image")
        answer = api_error(failure, retry_after=1, places=IMAGES)
        assert answer is not None
        assert answer.param == "messages"

    def test_an_unavailable_server_says_when_to_come_back(self) -> None:
        own = api_error(OverloadedError(3, retry_after=7), retry_after=1)
        assert own is not None
        assert own.headers == {"Retry-After": "7"}
        # Waiting will not help (a model larger than the budget): no header.
        never = api_error(
            UnavailableError("never.", "x", retry_after=None), retry_after=4
        )
        assert never is not None
        assert (never.status, never.headers) == (503, {})

    def test_the_threads_errors_go_through_the_same_table(self) -> None:
        answer = api_error(MLXThreadBusyError("full"), retry_after=2)
        assert answer is not None
        assert (answer.status, answer.code) == (503, "server_busy")
        assert answer.headers == {"Retry-After": "2"}

    def test_anything_else_is_not_known(self) -> None:
        assert api_error(ValueError("a bug"), retry_after=1) is None
