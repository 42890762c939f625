"""The transcription kind (speech to text): ``/v1/audio/transcriptions`` and
``/v1/audio/translations``. Any thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import Kind
from .values import TranscriptionEngine

if TYPE_CHECKING:
    from pathlib import Path

    from mlx_pinned import MLXThread

    from ...config import ModelSettings


def _load(settings: ModelSettings, thread: MLXThread) -> Any:
    from .engine import TranscriptionEngine

    return TranscriptionEngine.load(settings, thread)


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from .route import TranscriptionsEndpoint, TranslationsEndpoint

    return routes(TranscriptionsEndpoint(wiring), TranslationsEndpoint(wiring))


def _demo() -> Path:
    from mlx_pinned.testing import tiny_transcription_path

    return tiny_transcription_path()


KIND = Kind(
    name="transcription",
    what="a transcription model",
    paths=("/v1/audio/transcriptions", "/v1/audio/translations"),
    protocol=TranscriptionEngine,
    load=_load,
    routes=_routes,
    demo=_demo,
)
