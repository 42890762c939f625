"""Grammars for structured outputs and forced tool calls, checked before a
request waits for the model; the same check for every API.

Event loop, except the check itself: llguidance validates a grammar in a
worker thread (:func:`check_grammar`), and remembers its verdict per
grammar text (a schema sent again is not checked again). The engine
compiles the same grammar against the model's tokenizer on the MLX thread
and masks every step with it; a grammar it would refuse is a 400 here
instead, naming the parameter it came from. Each API's serving module
builds the grammar from its own fields (for chat completions,
:func:`.chat_completions.serving.request_grammar`).
"""

from __future__ import annotations

from collections import OrderedDict

import anyio
import llguidance

from ..events import Grammar
from .errors import APIError

__all__ = ["check_grammar", "grammar_error"]

# Verdicts by (kind, text), newest last: a grammar seen before is answered
# on the event loop, without a hop to a worker thread.
_VERDICTS: OrderedDict[tuple[str, str], str] = OrderedDict()
_KEPT = 512


def grammar_error(kind: str, source: str) -> str:
    """Why llguidance refuses the grammar; empty if it accepts it.

    Any thread (pure CPU, may take milliseconds for a large schema):
    :func:`check_grammar` calls it off the event loop, the first time a
    grammar is seen.
    """
    if kind == "json_object":
        return ""
    try:
        grammar = llguidance.grammar_from(
            "json_schema" if kind == "json_schema" else "lark", source
        )
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar)


async def check_grammar(grammar: Grammar, param: str) -> None:
    """Refuse a grammar llguidance cannot compile, off the event loop.

    Cancelling the caller abandons the check (it runs to its end in its
    worker thread, and its verdict is cached).

    Raises:
        APIError: 400 ``invalid_json_schema`` naming ``param``.
    """
    key = (grammar.kind, grammar.source)
    error = _VERDICTS.get(key)
    if error is None:
        error = await anyio.to_thread.run_sync(
            grammar_error, grammar.kind, grammar.source, abandon_on_cancel=True
        )
        _VERDICTS[key] = error
        if len(_VERDICTS) > _KEPT:
            _VERDICTS.popitem(last=False)
    else:
        _VERDICTS.move_to_end(key)
    if error:
        first = error.strip().splitlines()[0]
        raise APIError(
            400,
            f"Invalid value for '{param}': the schema cannot be used for "
            f"constrained decoding: {first}",
            param=param,
            code="invalid_json_schema",
        )
