"""Limits on a prompt's length, with errors that give the numbers: the exact
count on the MLX thread before any prefill, a cheap lower bound from the
text alone on the event loop before the request waits; and the one rule of
how many tokens a request may generate. Any thread.
"""

from __future__ import annotations

from typing import Any

from .failures import PromptTooLongError

__all__ = [
    "check_text_length",
    "context_length",
    "longest_token_chars",
    "max_tokens_for",
]


def context_length(config: Any) -> int | None:
    """``max_position_embeddings`` of the text config, else of the config."""
    for owner in (getattr(config, "text_config", None), config):
        value = getattr(owner, "max_position_embeddings", None)
        if isinstance(owner, dict):
            value = owner.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def max_tokens_for(
    prompt_tokens: int,
    max_tokens: int,
    *,
    max_prompt_tokens: int | None,
    context: int | None,
) -> int:
    """The tokens a request may generate after a prompt of ``prompt_tokens``:
    ``max_tokens``, cut to what the model's ``context`` leaves (an answer so
    cut ends as ``length``, as OpenAI's and Ollama's do).

    Raises:
        PromptTooLongError: The prompt is over ``max_prompt_tokens``, or
            leaves no room in ``context`` for the tokens asked (none where
            ``max_tokens`` is 0).
    """
    if max_prompt_tokens is not None and prompt_tokens > max_prompt_tokens:
        raise PromptTooLongError(
            f"The prompt is {prompt_tokens} tokens (images included); this "
            f"server's limit is {max_prompt_tokens} prompt tokens: shorten the "
            "messages or send fewer or smaller images.",
            prompt_tokens,
            max_prompt_tokens,
        )
    if context is None:
        return max_tokens
    if prompt_tokens + min(max_tokens, 1) > context:
        raise PromptTooLongError(
            f"This model's maximum context length is {context} tokens; the "
            f"prompt has {prompt_tokens} tokens, which leaves no room for an "
            "answer: shorten the messages.",
            prompt_tokens,
            context,
        )
    return min(max_tokens, context - prompt_tokens)


def check_text_length(chars: int, longest_token: int, max_prompt_tokens: int) -> None:
    """Refuse text that cannot fit, before it is tokenized: no token covers
    more than ``longest_token`` characters.

    Raises:
        PromptTooLongError: The text alone is over ``max_prompt_tokens``.
    """
    at_least = chars // max(1, longest_token)
    if at_least > max_prompt_tokens:
        raise PromptTooLongError(
            f"The messages hold {chars} characters of text, at least {at_least} "
            f"tokens; this server's limit is {max_prompt_tokens} prompt tokens: "
            "shorten the messages.",
            at_least,
            max_prompt_tokens,
        )


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest token of the vocabulary (byte-level BPE
    spells each byte as one, so this bounds the text a token covers)."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return 1 << 30  # unknown: the text bound never refuses
    return max((len(token) for token in vocab), default=1)
