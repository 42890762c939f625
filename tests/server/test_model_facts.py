"""What a loaded model is, said once: its engine builds one frozen value at
load (its limits, what it takes, its template and formats), and the doors
and ``/v1/models`` read that value, never the engine's internals again."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_pinned.server.engine import batch
from mlx_pinned.server.events import ChatFacts
from mlx_pinned.server.formats import ModelFormats, model_formats

from .conftest import MODEL
from .kit import Serve

pytestmark = pytest.mark.anyio


@pytest.fixture
def detections(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The templates the formats are detected from, one entry a detection."""
    seen: list[str | None] = []

    def counted(template: str | None, **settings: Any) -> ModelFormats:
        seen.append(template)
        return model_formats(template, **settings)

    monkeypatch.setattr(batch, "model_formats", counted)
    return seen


async def test_the_facts_are_built_once_at_load(
    serve: Serve, detections: list[str | None]
) -> None:
    async with serve() as served:
        assert len(detections) == 1  # at load, before any request
        body = {"model": MODEL, "max_tokens": 2}
        chat = {**body, "messages": [{"role": "user", "content": "Hi"}]}
        for _ in range(3):
            assert (await served.chat(chat)).status_code == 200
        answer = await served.client.post("/v1/messages", json=chat)
        assert answer.status_code == 200, answer.text
        tokenize = {"model": MODEL, "messages": chat["messages"]}
        tokens = await served.client.post("/tokenize", json=tokenize)
        assert tokens.status_code == 200, tokens.text
    assert len(detections) == 1


async def test_the_facts_say_what_the_model_takes(serve: Serve) -> None:
    async with serve() as served:
        engine = served.app.state.models.get(MODEL).engine()
        facts = engine.facts
        assert isinstance(facts, ChatFacts)
        loaded = engine.loaded
        assert facts.vocab_size == loaded.vocab_size
        assert facts.context_length == loaded.context_length
        assert facts.accepts_images is True  # the tiny Qwen3-VL
        assert facts.audio_input is None
        assert facts.formats.names() == {"tool_calls": "hermes", "reasoning": "think"}
        card = (await served.client.get(f"/v1/models/{MODEL}")).json()
        assert card["formats"] == facts.formats.names()
        assert card["input_modalities"] == ["text", "image"]


def test_a_card_names_only_what_the_model_takes() -> None:
    formats = model_formats(None)
    text_only = ChatFacts(10, 100, 4, False, None, formats)
    assert text_only.card()["input_modalities"] == ["text"]
    listening = ChatFacts(10, 100, 4, True, None, formats, audio_input=object())  # type: ignore[arg-type]
    assert listening.card()["input_modalities"] == ["text", "image", "audio"]
