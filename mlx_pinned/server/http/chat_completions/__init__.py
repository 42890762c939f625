"""OpenAI's chat completions: ``POST /v1/chat/completions``. Event loop only."""

from .route import ChatCompletionsEndpoint as ChatCompletionsEndpoint

__all__ = ["ChatCompletionsEndpoint"]
