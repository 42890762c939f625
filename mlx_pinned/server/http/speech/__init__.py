"""The speech slice of the HTTP side: OpenAI's ``POST /v1/audio/speech``.

Event loop only, as all of :mod:`..http`. The protocol (:mod:`.protocol`:
OpenAI's request, which turns into the shared
:class:`~...speech.SpeechParams`), its checks against the model
(:mod:`.serving`), the audio formats (:mod:`.formats`) and the route
(:mod:`.route`); the model speaks where its engine keeps it, on the MLX
thread (:class:`~...speech.SpeechEngine`).
"""

from .route import SpeechEndpoint as SpeechEndpoint

__all__ = ["SpeechEndpoint"]
