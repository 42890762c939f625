"""What a served model can take is read once per load of it, not once per
request: its formats are detected from its template when a request first
needs them, and kept on its slot until it is loaded again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from mlx_pinned.server.formats import ModelFormats, model_formats
from mlx_pinned.server.http import slots as capabilities
from mlx_pinned.server.http.served_models import BatchGate, ServedModel
from mlx_pinned.server.http.slots import Capabilities, ModelSlot
from mlx_pinned.testing import _CHAT_TEMPLATE

from .conftest import MODEL
from .kit import Serve

pytestmark = pytest.mark.anyio


@dataclass
class Loaded:
    """What :meth:`Capabilities.of` reads of an engine."""

    context_length: int | None = 4096
    vocab_size: int = 1000
    longest_token_chars: int = 16
    accepts_images: bool = True
    chat_template: str | None = _CHAT_TEMPLATE
    audio_input: Any = None


@pytest.fixture
def detections(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The templates the formats are detected from, one entry a detection."""
    seen: list[str | None] = []

    def counted(template: str | None, **settings: Any) -> ModelFormats:
        seen.append(template)
        return model_formats(template, **settings)

    monkeypatch.setattr(capabilities, "model_formats", counted)
    return seen


def served_model(engine: Any) -> ServedModel:
    async def never() -> Any:
        raise AssertionError("not loaded in this test")

    slot = ModelSlot("m", never, never, engine=engine)
    return ServedModel("m", BatchGate(1, 0), slot)


class TestCapabilities:
    def test_they_are_read_once_per_load(self, detections: list[str | None]) -> None:
        engine: Any = Loaded()
        served = served_model(engine)
        first = Capabilities.of(engine, served)
        assert Capabilities.of(engine, served) is first
        assert detections == [_CHAT_TEMPLATE]
        assert first.vocab_size == 1000
        assert first.formats.tool_call is not None

    def test_an_engine_not_its_slots_is_read_and_not_kept(
        self, detections: list[str | None]
    ) -> None:
        served = served_model(Loaded())
        other: Any = Loaded(vocab_size=2000, chat_template=None)
        assert Capabilities.of(other, served).vocab_size == 2000
        assert served.slot.capabilities is None
        assert detections == [None]

    async def test_requests_share_one_reading(
        self, serve: Serve, detections: list[str | None]
    ) -> None:
        async with serve() as served:
            body = {"model": MODEL, "max_tokens": 2}
            chat = {**body, "messages": [{"role": "user", "content": "Hi"}]}
            for _ in range(3):
                assert (await served.chat(chat)).status_code == 200
            answer = await served.client.post(
                "/v1/messages", json={**chat, "max_tokens": 2}
            )
            assert answer.status_code == 200, answer.text
        assert len(detections) == 1
