"""The pythonic tool-call format: a Python list of calls with keyword arguments.

Any thread, pure Python. LFM2 and the models tuned like it write
``<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>``
(several calls in the one list, the list Llama 4's pythonic prompts ask
for). Detected by mlx-vlm (``pythonic``: the template names
``<|tool_call_start|>`` and ``<|tool_call_end|>``, or
``<|tool_list_start|>``); decoded by mlx-vlm's parser (Python literals,
read with ``ast``).
:func:`grammar` forces strings, numbers, booleans and enums; a tool taking
objects or lists is refused, since JSON's ``true`` and ``null`` are no
Python literals.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import ToolCallFormat, ToolCallParser, ToolSpec, UnforcedCallError
from .blocks import BlockToolParser, Markers, grammar_of_calls, literal, property_items
from .vlm import vlm_decoder, vlm_detects

__all__ = ["PYTHONIC", "grammar"]

NAME = "pythonic"
OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"


def _value(tool: str, key: str, schema: dict[str, Any]) -> str:
    values = schema.get("enum")
    kind = schema.get("type")
    if values and all(isinstance(v, str | int) for v in values):
        return " | ".join(literal(repr(v)) for v in values)
    if kind == "string" and not {"pattern", "format"} & set(schema):
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return f'/"[^"\\\\\\n]{{{low},{high}}}"/'
    if kind in ("integer", "number"):
        return f"%json {json.dumps(schema)}"
    if kind == "boolean":
        return '"True" | "False"'
    raise UnforcedCallError(
        f"The {NAME} tool-call format cannot force {tool}'s argument {key!r} "
        f"(type {kind or 'any'}): it writes Python literals, and forces only "
        "strings, numbers, booleans and enums; use tool_choice 'auto'."
    )


def _call(i: int, tool: ToolSpec) -> list[str]:
    rules, arguments = [], []
    for k, (key, schema, required) in enumerate(property_items(tool.parameters)):
        if required:
            rules.append(f"value_{i}_{k}: {_value(tool.name, key, schema)}")
            arguments.append(f"{literal(key + '=')} value_{i}_{k}")
    inner = ' ", " '.join(arguments)
    return [f"call_{i}: {literal(tool.name + '(')} {inner} " + '")"', *rules]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """A Lark grammar for a list of one call (or, with ``parallel``, one or
    more) to ``tools``, each with its required arguments in order."""
    return grammar_of_calls(
        tools, parallel, _call, before=f"{OPEN}[", between=", ", after=f"]{CLOSE}"
    )


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


def parser(tools: Sequence[ToolSpec] = ()) -> ToolCallParser:
    """A parser of one answer's pythonic calls."""
    return BlockToolParser(_SYNTAX, tools)


#: The pythonic format, an entry of the registry.
PYTHONIC = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=parser,
    grammar=grammar,
    markers=(OPEN, CLOSE),
)
