"""The chat-completions slice of the HTTP side: ``POST /v1/chat/completions``.

Event loop only, as all of :mod:`..http`. A slice per API, each in three
steps: the protocol (:mod:`.protocol`, with :mod:`.messages` and
:mod:`.bodies`: OpenAI's pydantic models, which turn themselves into the
shared :class:`~...events.GenerationParams`); the serving
(:mod:`.serving`: the one place a request is checked against the model's
:class:`~...events.ChatFacts`); the route (:mod:`.route`: the ASGI
endpoint, from the body to the last byte of the answer, written by
:mod:`.output`). Every slice shares the rest of :mod:`..http` (errors, wire,
gate, model registry, answer parser) and the one engine.
"""

from .route import ChatCompletionsEndpoint as ChatCompletionsEndpoint

__all__ = ["ChatCompletionsEndpoint"]
