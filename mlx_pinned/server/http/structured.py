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

import anyio
import llguidance

from ..events import Grammar
from ..formats import TOOL_CALL_FORMATS, ToolCallFormat, ToolSpec, json_arguments
from .chat_completions.messages import (
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
)
from .chat_completions.protocol import ChatCompletionRequest
from .errors import APIError

__all__ = ["check_grammar", "grammar_error", "request_grammar"]

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


async def request_grammar(
    request: ChatCompletionRequest, tool_format: ToolCallFormat | None
) -> Grammar | None:
    """The grammar the request's answer must follow, checked; None if free.

    ``response_format`` ``json_object`` or ``json_schema``; ``tool_choice``
    ``required`` (one call, or with ``parallel_tool_calls`` not false, one or
    more, of the tools) or a named function (exactly one call to it), in the
    model's ``tool_format``.

    Raises:
        APIError: 400 naming the schema that cannot be used, or ``tools``
            when the model has no tool-call format.
    """
    if request.active_tools and tool_format is None:
        raise APIError(
            400,
            "This model has no tool-call format (none in its chat template, "
            "or tool_call_parser 'none'): send the request without tools, or "
            f"serve it with --tool-call-parser {'|'.join(TOOL_CALL_FORMATS)}.",
            param="tools",
            code="unsupported_parameter",
        )
    choice = request.tool_choice
    named = isinstance(choice, NamedToolChoice)
    if tool_format is not None and request.tools and (choice == "required" or named):
        tools = request.tools
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == choice.function.name]
        for i, tool in enumerate(request.tools):
            if tool in tools and tool.function.parameters is not None:
                schema = json.dumps(json_arguments(tool.function.parameters))
                await check_grammar(
                    Grammar("json_schema", schema), f"tools[{i}].function.parameters"
                )
        specs = [ToolSpec(t.function.name, t.function.parameters) for t in tools]
        parallel = not named and request.parallel_tool_calls is not False
        grammar = Grammar("lark", tool_format.grammar(specs, parallel))
        await check_grammar(grammar, "tools")
        return grammar
    response_format = request.response_format
    if isinstance(response_format, JSONObjectFormat):
        return Grammar("json_object")
    if isinstance(response_format, JSONSchemaResponseFormat):
        wanted = response_format.json_schema.json_schema
        # As sent: the engine compiles a response_format schema's JSON
        # compactly itself.
        grammar = Grammar("json_schema", json.dumps(wanted or {}))
        await check_grammar(grammar, "response_format")
        return grammar
    return None
