"""The transcription kind (speech to text): ``/v1/audio/transcriptions`` and
``/v1/audio/translations``. Any thread."""

from __future__ import annotations

from .. import Kind
from .values import TranscriptionEngine

KIND = Kind(
    name="transcription",
    what="a transcription model",
    paths=("/v1/audio/transcriptions", "/v1/audio/translations"),
    protocol=TranscriptionEngine,
)
