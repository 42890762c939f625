"""The speech kind (text to speech): ``/v1/audio/speech``. Any thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import Kind
from .values import SpeechEngine

if TYPE_CHECKING:
    from pathlib import Path

    from mlx_pinned import MLXThread

    from ...config import ModelSettings


def _load(settings: ModelSettings, thread: MLXThread) -> Any:
    from .engine import SpeechEngine

    return SpeechEngine.load(settings, thread)


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from .route import SpeechEndpoint

    return routes(SpeechEndpoint(wiring))


def _demo() -> Path:
    from mlx_pinned.testing import tiny_speech_path

    return tiny_speech_path()


KIND = Kind(
    name="speech",
    what="a speech model",
    paths=("/v1/audio/speech",),
    protocol=SpeechEngine,
    load=_load,
    routes=_routes,
    demo=_demo,
)
