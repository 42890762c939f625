"""The speech kind (text to speech): ``/v1/audio/speech``. Any thread."""

from __future__ import annotations

from .. import Kind
from .values import SpeechEngine

KIND = Kind(
    name="speech",
    what="a speech model",
    paths=("/v1/audio/speech",),
    protocol=SpeechEngine,
)
