"""OpenAI's legacy completions: ``POST /v1/completions``, raw prompts with no
chat template. Event loop only."""

from .route import CompletionsEndpoint as CompletionsEndpoint

__all__ = ["CompletionsEndpoint"]
