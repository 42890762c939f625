"""Grammars for structured outputs and forced tool calls, checked before a
request waits for the model.

Event loop, except the check itself: llguidance validates a grammar in a
worker thread (:func:`check_grammar`), and remembers its verdict per
grammar text (a schema sent again is not checked again). The engine
compiles the same grammar against the model's tokenizer on the MLX thread
and masks every step with it; a grammar it would refuse is a 400 here
instead, naming the parameter it came from.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import anyio
import llguidance

from ..errors import APIError
from ..events import Grammar
from .messages import (
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
    Tool,
)
from .schemas import ChatCompletionRequest

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "check_grammar",
    "grammar_error",
    "request_grammar",
    "tool_call_grammar",
]

#: Hermes' (and Qwen's) tool-call markers; the JSON between them is
#: ``{"name": NAME, "arguments": ARGS}``.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# Tool arguments in a call are written as Qwen's template writes them
# (json.dumps' separators, no other whitespace), so a model (above all a
# random one) cannot spend its tokens on blank space. A schema's own
# x-guidance wins. (A response_format schema goes to the engine as sent: it
# compiles JSON compactly itself.)
_JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Any object: what a tool without 'parameters' takes.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": _JSON_STYLE}


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


def tool_call_grammar(tools: Sequence[Tool], *, parallel: bool) -> str:
    """A Lark grammar for one tool call (or, with ``parallel``, one or more,
    a newline apart) in Hermes' format to one of ``tools``, its arguments
    constrained by the tool's ``parameters`` schema."""
    rules = []
    for i, tool in enumerate(tools):
        head = f'{TOOL_CALL_OPEN}\n{{"name": "{tool.function.name}", "arguments": '
        schema = _styled(tool.function.parameters or _ANY_OBJECT)
        rules.append(
            f"call_{i}: {json.dumps(head)} args_{i} "
            f"{json.dumps('}' + chr(10) + TOOL_CALL_CLOSE)}"
        )
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"


async def request_grammar(request: ChatCompletionRequest) -> Grammar | None:
    """The grammar the request's answer must follow, checked; None if free.

    ``response_format`` ``json_object`` or ``json_schema``; ``tool_choice``
    ``required`` or a named function (one call, or with
    ``parallel_tool_calls`` not false, one or more, of the allowed tools).

    Raises:
        APIError: 400 naming the schema that cannot be used.
    """
    choice = request.tool_choice
    if request.tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        tools = request.tools
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == choice.function.name]
        for i, tool in enumerate(request.tools):
            if tool in tools and tool.function.parameters is not None:
                schema = json.dumps(_styled(tool.function.parameters))
                await check_grammar(
                    Grammar("json_schema", schema), f"tools[{i}].function.parameters"
                )
        parallel = request.parallel_tool_calls is not False
        grammar = Grammar("lark", tool_call_grammar(tools, parallel=parallel))
        await check_grammar(grammar, "tools")
        return grammar
    response_format = request.response_format
    if isinstance(response_format, JSONObjectFormat):
        return Grammar("json_object")
    if isinstance(response_format, JSONSchemaResponseFormat):
        wanted = response_format.json_schema.json_schema
        grammar = Grammar("json_schema", json.dumps(wanted or {}))
        await check_grammar(grammar, "response_format")
        return grammar
    return None
