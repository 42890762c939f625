"""Gemma 4's tool-call format: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``.

Any thread, pure Python. Gemma 4 writes each call as its own block, its
arguments in Gemma's own object syntax: keys bare, strings between
``<|"|>`` quotes, numbers and booleans bare, objects in braces. Detected
by mlx-vlm (``gemma4``: the template names ``<|tool_call>``) and decoded by
its parser; :func:`grammar` forces strings, numbers, booleans and enums (a
tool taking objects or lists is refused: they are not JSON here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import ToolCallFormat, ToolCallParser, ToolSpec, UnforcedCallError
from .blocks import BlockToolParser, Markers, grammar_of_calls, literal, property_items
from .vlm import vlm_decoder, vlm_detects

__all__ = ["GEMMA4", "grammar"]

NAME = "gemma4"
OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'


def _value(tool: str, key: str, schema: dict[str, Any]) -> str:
    values = schema.get("enum")
    kind = schema.get("type")
    if values and all(isinstance(v, str) for v in values):
        return " | ".join(literal(QUOTE + v + QUOTE) for v in values)
    if kind == "string" and not {"pattern", "format"} & set(schema):
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return f"{literal(QUOTE)} /[^<\\n]{{{low},{high}}}/ {literal(QUOTE)}"
    if kind in ("integer", "number", "boolean"):
        return f"%json {json.dumps(schema)}"
    raise UnforcedCallError(
        f"The {NAME} tool-call format cannot force {tool}'s argument {key!r} "
        f"(type {kind or 'any'}): it forces only strings, numbers, booleans "
        "and enums; use tool_choice 'auto'."
    )


def _call(i: int, tool: ToolSpec) -> list[str]:
    rules, arguments = [], []
    for k, (key, schema, required) in enumerate(property_items(tool.parameters)):
        if required:
            rules.append(f"value_{i}_{k}: {_value(tool.name, key, schema)}")
            arguments.append(f"{literal(key + ':')} value_{i}_{k}")
    inner = ' "," '.join(arguments)
    head, tail = literal(f"{OPEN}call:{tool.name}{{"), literal("}" + CLOSE)
    return [f"call_{i}: {head} {inner} {tail}", *rules]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """A Lark grammar for one call (or, with ``parallel``, one or more) to
    one of ``tools``, each with its required arguments in order."""
    return grammar_of_calls(tools, parallel, _call)


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


def parser(tools: Sequence[ToolSpec] = ()) -> ToolCallParser:
    """A parser of one answer's Gemma 4 calls."""
    return BlockToolParser(_SYNTAX, tools)


#: Gemma 4's format, an entry of the registry.
GEMMA4 = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=parser,
    grammar=grammar,
    markers=(OPEN, CLOSE, QUOTE),
)
