"""The legacy completions slice of the HTTP side: ``POST /v1/completions``.

Event loop only, as all of :mod:`..http`. The three steps of every slice:
the protocol (:mod:`.protocol`: OpenAI's pydantic models, which turn each
prompt into the shared :class:`~...events.GenerationParams` with a raw
``prompt``: no chat template); the serving (:mod:`.serving`: the one place
a request is checked against the model's
:class:`~...events.ChatFacts`); the route (:mod:`.route`, written
by :mod:`.output`).
"""

from .route import CompletionsEndpoint as CompletionsEndpoint

__all__ = ["CompletionsEndpoint"]
