"""Speech's one validation site: a parsed request checked against the
served speech model, and turned into the shared speech request.

Event loop. Checked here: the format (one this server encodes) before the
model is even looked up, then, before the request waits for the model's
gate, the voice (one of the model's) and the settings the model does not
honour (``speed`` other than 1, ``instructions`` to a model that takes
none), each refused by name rather than ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...http.errors import APIError
from .encoding import ENCODED, STREAMED

if TYPE_CHECKING:
    from .protocol import SpeechRequest
    from .values import SpeechFacts, SpeechParams

__all__ = ["SpeechServing"]


class SpeechServing:
    """Checks speech requests against this server and the served model."""

    def check_format(self, request: SpeechRequest) -> None:
        """Refuse a format this server does not encode, or does not stream
        when ``stream_format`` asks for a stream (whatever the model).

        Raises:
            APIError: 400 naming ``response_format``.
        """
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
        """Check ``request`` against the model; its speech request.

        Raises:
            APIError: 400 naming ``voice`` (not one of the model's),
                ``speed`` (not 1, to a model of one speed) or
                ``instructions`` (the model takes none).
        """
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
