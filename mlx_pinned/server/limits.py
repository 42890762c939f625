"""Limits on a prompt's length, with errors that give the numbers.

Pure Python: the checks run wherever the numbers are known, and raise
:class:`~.failures.PromptTooLongError`. The exact prompt
length is known only on the MLX thread, after the chat template and the image
processor ran (:func:`check_prompt_tokens`, before any prefill); a cheap lower
bound from the text alone refuses a huge prompt on the event loop, before it
waits for the model (:func:`check_text_length`).
"""

from __future__ import annotations

from typing import Any

from .failures import PromptTooLongError

__all__ = [
    "check_prompt_tokens",
    "check_text_length",
    "context_length",
    "longest_token_chars",
]


def context_length(config: Any) -> int | None:
    """The model's context length from its config, or None if it has none.

    Reads ``max_position_embeddings`` of the text config, else of the config
    (Qwen-VL and most mlx-vlm models have one of the two).
    """
    for owner in (getattr(config, "text_config", None), config):
        value = getattr(owner, "max_position_embeddings", None)
        if isinstance(owner, dict):
            value = owner.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompt_tokens(
    prompt_tokens: int,
    max_tokens: int,
    *,
    max_prompt_tokens: int | None,
    context: int | None,
) -> None:
    """Refuse a prompt over ``max_prompt_tokens`` or one that, with
    ``max_tokens``, does not fit in the model's ``context``.

    Raises:
        PromptTooLongError: Over a limit; the message gives the numbers.
    """
    if max_prompt_tokens is not None and prompt_tokens > max_prompt_tokens:
        raise PromptTooLongError(
            f"The prompt is {prompt_tokens} tokens (images included); this "
            f"server's limit is {max_prompt_tokens} prompt tokens: shorten the "
            "messages or send fewer or smaller images.",
            prompt_tokens,
            max_prompt_tokens,
        )
    if context is not None and prompt_tokens + max_tokens > context:
        raise PromptTooLongError(
            f"This model's maximum context length is {context} tokens; the "
            f"request has {prompt_tokens} prompt tokens and asks for up to "
            f"{max_tokens} completion tokens ({prompt_tokens + max_tokens} in "
            "all): shorten the messages or lower max_tokens.",
            prompt_tokens,
            context,
        )


def check_text_length(chars: int, longest_token: int, max_prompt_tokens: int) -> None:
    """Refuse text that cannot fit, before it is tokenized.

    No token covers more than ``longest_token`` characters, so ``chars`` of
    text are at least ``chars / longest_token`` tokens.

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
    """Characters in the longest token of ``tokenizer``'s vocabulary.

    Byte-level BPE spells each byte as one character, so this bounds the
    characters of text a token can cover in either kind of vocabulary.
    """
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return 1 << 30  # unknown: the text bound never refuses
    return max((len(token) for token in vocab), default=1)
