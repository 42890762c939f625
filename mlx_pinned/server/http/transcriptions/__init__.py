"""The transcription slice of the HTTP side: OpenAI's
``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``.

Event loop only, as all of :mod:`..http`. The protocol (:mod:`.protocol`:
OpenAI's multipart form), what it makes of a form and of the engine's
windows (:mod:`.serving`: the shared
:class:`~...transcripts.TranscriptionParams`, the answer in each format)
and the routes (:mod:`.route`); the model runs where its engine keeps it,
on the MLX thread (:class:`~...transcripts.TranscriptionEngine`).
"""

from .route import TranscriptionsEndpoint as TranscriptionsEndpoint
from .route import TranslationsEndpoint as TranslationsEndpoint

__all__ = ["TranscriptionsEndpoint", "TranslationsEndpoint"]
