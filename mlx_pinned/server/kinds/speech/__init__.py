"""The speech kind (text to speech): ``/v1/audio/speech``. Any thread."""

from __future__ import annotations

from ...speech import SpeechEngine
from .. import Kind

KIND = Kind(
    name="speech",
    what="a speech model",
    paths=("/v1/audio/speech",),
    protocol=SpeechEngine,
)
