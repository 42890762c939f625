"""The body of OpenAI's ``POST /v1/audio/speech``, as a pydantic model. Any
thread. A blank ``input`` is refused; the formats this server does not
encode are refused by :mod:`.serving`."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, field_validator

from ...http.protocol_common import RequestBody
from ...http.validation import parse_request
from .values import SpeechParams

__all__ = [
    "MAX_INPUT_CHARS",
    "ResponseFormat",
    "SpeechRequest",
    "VoiceId",
    "parse_speech_request",
]

#: Characters one request may speak (OpenAI's limit).
MAX_INPUT_CHARS: Final = 4096

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class VoiceId(RequestBody):
    """OpenAI's custom voice reference: a voice named by its ``id``."""

    id: str


class SpeechRequest(RequestBody):
    model: str
    input: str = Field(max_length=MAX_INPUT_CHARS)
    voice: str | VoiceId
    instructions: str | None = None
    response_format: ResponseFormat = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("it is empty; send the text to speak")
        return value

    @property
    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id

    def to_speech_params(self, voice: str) -> SpeechParams:
        """The shared speech request, in ``voice`` (the model's name of the
        voice asked for)."""
        return SpeechParams(self.input, voice, self.instructions or None, self.speed)


def parse_speech_request(body: bytes) -> SpeechRequest:
    """Parse and validate a ``/v1/audio/speech`` body; a 400
    :class:`APIError` names the first invalid parameter."""
    return parse_request(SpeechRequest, body)
