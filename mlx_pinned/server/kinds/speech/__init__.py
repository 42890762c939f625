"""The speech kind (text to speech): ``/v1/audio/speech``. Any thread."""

from __future__ import annotations

from typing import Any

from .. import Kind
from .values import SpeechEngine


def _routes(wiring: Any) -> list[Any]:
    from ...http.door import routes
    from .route import SpeechEndpoint

    return routes(SpeechEndpoint(wiring))


KIND = Kind(
    name="speech",
    what="a speech model",
    paths=("/v1/audio/speech",),
    protocol=SpeechEngine,
    routes=_routes,
)
