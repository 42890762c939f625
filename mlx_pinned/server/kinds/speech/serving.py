"""Speech's one validation site: a request checked against the formats this
server encodes, then against the served model, each setting it does not
honour refused by name rather than ignored. Event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...http.errors import APIError
from .encoding import ENCODED, STREAMED

if TYPE_CHECKING:
    from .protocol import SpeechRequest
    from .values import SpeechFacts, SpeechParams

__all__ = ["SpeechServing"]


class SpeechServing:
    def check_format(self, request: SpeechRequest) -> None:
        """Refuse (400, naming ``response_format``) a format this server does
        not encode, or does not stream when ``stream_format`` asks for a
        stream, whatever the model."""
        if request.response_format not in ENCODED:
            raise _refused(
                "response_format",
                f"{request.response_format!r} is not encoded by this server; "
                f"ask for {', '.join(ENCODED)}",
            )
        if request.stream_format and request.response_format not in STREAMED:
            raise _refused(
                "response_format",
                f"{request.response_format!r} is encoded once the speech is "
                f"made, not streamed; stream {', '.join(STREAMED)}, or leave "
                "stream_format out for the whole file",
            )

    def prepare(self, request: SpeechRequest, facts: SpeechFacts) -> SpeechParams:
        """``request``'s speech request, in the model's name of its voice; a
        400 names what the model does not take."""
        voice = request.voice_name.lower()
        if voice not in facts.voices:
            listed = ", ".join(facts.voices)
            raise _refused(
                "voice",
                f"{request.voice_name!r} is not a voice of this model; "
                f"its voices are {listed}",
            )
        if request.speed != 1.0 and not facts.takes_speed:
            raise _refused(
                "speed",
                f"{request.speed}; this model speaks at one speed: leave it out "
                "or send 1.0",
            )
        if request.instructions and not facts.takes_instructions:
            raise _refused(
                "instructions",
                "this model is not steered by instructions; leave them out",
            )
        return request.to_speech_params(voice)


def _refused(param: str, why: str) -> APIError:
    return APIError(
        400, f"Invalid value for '{param}': {why}.", param=param, code="invalid_value"
    )
