"""The Anthropic Messages slice of the HTTP side: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Event loop only, as all of :mod:`..http`. The same three steps as every
slice: the protocol (:mod:`.protocol`, with :mod:`.content`: Anthropic's
pydantic models, which turn themselves into the shared
:class:`~...events.GenerationParams`); the serving (:mod:`.serving`: the one
place a request is checked against the model's
:class:`~..slots.Capabilities`); the route (:mod:`.route`, writing
Anthropic's answer and events with :mod:`.output`, and its errors in
Anthropic's shape with :mod:`.errors`).
"""

from .route import CountTokensEndpoint as CountTokensEndpoint
from .route import MessagesEndpoint as MessagesEndpoint

__all__ = ["CountTokensEndpoint", "MessagesEndpoint"]
