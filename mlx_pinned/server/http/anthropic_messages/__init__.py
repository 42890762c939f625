"""The Anthropic Messages slice: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``. Event loop only: the protocol
(:mod:`.protocol`, :mod:`.content`), the one check against the model
(:mod:`.serving`), the doors (:mod:`.route`) and Anthropic's answers,
events and error shape (:mod:`.output`).
"""

from .route import CountTokensEndpoint as CountTokensEndpoint
from .route import MessagesEndpoint as MessagesEndpoint

__all__ = ["CountTokensEndpoint", "MessagesEndpoint"]
