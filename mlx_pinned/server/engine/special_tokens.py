"""A format's markers that are special tokens, written as the tokens in a
grammar (llguidance matches a string literal against ordinary tokens only).
MLX thread only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import LoadedModel

__all__ = ["special_literals", "special_tokens"]


def special_tokens(loaded: LoadedModel) -> dict[str, int]:
    """The tokenizer's special tokens by their text (``[TOOL_CALLS]``)."""
    added = getattr(loaded.tokenizer, "added_tokens_decoder", None) or {}
    return {
        str(token.content): int(index)
        for index, token in added.items()
        if getattr(token, "special", False) and getattr(token, "content", "")
    }


# A Lark string literal, as the formats write them (JSON-escaped).
_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def special_literals(source: str, specials: Mapping[str, int]) -> str:
    """``source`` (a Lark grammar) with each special token spelled in a
    string literal written as the token itself (``<[5]>``): a literal
    ``"[TOOL_CALLS]"`` could never be generated where that is one token."""
    if not specials:
        return source
    names = sorted(specials, key=len, reverse=True)
    split = re.compile("|".join(re.escape(name) for name in names))

    def rewrite(match: re.Match[str]) -> str:
        try:
            text = json.loads(match.group(0))
        except ValueError:
            return match.group(0)
        if not isinstance(text, str) or split.search(text) is None:
            return match.group(0)
        parts: list[str] = []
        at = 0
        for found in split.finditer(text):
            if found.start() > at:
                parts.append(json.dumps(text[at : found.start()]))
            parts.append(f"<[{specials[found.group(0)]}]>")
            at = found.end()
        if at < len(text):
            parts.append(json.dumps(text[at:]))
        return "(" + " ".join(parts) + ")"

    return _LITERAL.sub(rewrite, source)
