"""Anthropic's Messages API: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, in Anthropic's shape. Event loop only."""

from .route import CountTokensEndpoint as CountTokensEndpoint
from .route import MessagesEndpoint as MessagesEndpoint

__all__ = ["CountTokensEndpoint", "MessagesEndpoint"]
