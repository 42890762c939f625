"""Gemma 4's tool-call format: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``.

Any thread, pure Python. Each call is its own block, its arguments in
Gemma's object syntax (bare keys, strings between ``<|"|>`` quotes).
Detected and decoded by mlx-vlm; the grammar writes values through
:mod:`.literals`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import ToolCallFormat, ToolSpec
from .blocks import Markers, grammar_of_calls, literal, property_items
from .literals import LiteralSyntax, value_rules
from .vlm import vlm_decoder, vlm_detects

__all__ = ["GEMMA4", "grammar"]

NAME = "gemma4"
OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'


SYNTAX = LiteralSyntax(
    format=NAME,
    quote=QUOTE,
    unquoted="^<\\n",
    true="true",
    false="false",
    null="null",
    separator=",",
    key_format="{key}:",
    any_key='/[A-Za-z_][A-Za-z0-9_]*/ ":"',
)


def _call(i: int, tool: ToolSpec) -> list[str]:
    rules, arguments = [], []
    for k, (key, schema, required) in enumerate(property_items(tool.parameters)):
        if required:
            rules += value_rules(SYNTAX, tool.name, key, schema, f"value_{i}_{k}")
            arguments.append(f"{literal(key + ':')} value_{i}_{k}")
    inner = ' "," '.join(arguments)
    head, tail = literal(f"{OPEN}call:{tool.name}{{"), literal("}" + CLOSE)
    return [f"call_{i}: {head} {inner} {tail}", *rules]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """Each call with its required arguments, in order."""
    return grammar_of_calls(tools, parallel, _call)


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


GEMMA4 = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=_SYNTAX.parser,
    grammar=grammar,
    markers=(OPEN, CLOSE, QUOTE),
)
