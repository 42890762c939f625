"""Qwen3-Coder's tool-call format: XML functions and parameters.

Any thread, pure Python. Qwen3-Coder and Qwen3.5 write each call as
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
</function>\\n</tool_call>``; a value is raw text, typed by the tool's
schema (a string stays text, an integer or an object is read as JSON).
Detected and decoded by mlx-vlm (``qwen3_coder``), which reads the types
from the request's tools; :func:`grammar` forces calls in this syntax.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import ToolCallFormat, ToolCallParser, ToolSpec
from .blocks import (
    BlockToolParser,
    Markers,
    grammar_of_calls,
    literal,
    property_items,
    raw_value,
)
from .vlm import vlm_decoder, vlm_detects

__all__ = ["QWEN3_CODER", "grammar"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = "qwen3_coder"


def _call(i: int, tool: ToolSpec) -> list[str]:
    head = f"{OPEN}\n<function={tool.name}>\n"
    params, rules = [], []
    for k, (key, schema, required) in enumerate(property_items(tool.parameters)):
        value = raw_value(NAME, tool.name, key, schema)
        rules.append(f"value_{i}_{k}: {value}")
        rules.append(
            f"param_{i}_{k}: {literal(f'<parameter={key}>' + chr(10))} value_{i}_{k} "
            f"{literal(chr(10) + '</parameter>' + chr(10))}"
        )
        params.append(f"param_{i}_{k}" + ("" if required else "?"))
    tail = literal(f"</function>\n{CLOSE}")
    return [f"call_{i}: {literal(head)} {' '.join(params)} {tail}", *rules]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """A Lark grammar for one call (or, with ``parallel``, one or more, a
    newline apart) to one of ``tools``: each of its parameters in the
    schema's order, the required ones always."""
    return grammar_of_calls(tools, parallel, _call, between="\n")


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


def parser(tools: Sequence[ToolSpec] = ()) -> ToolCallParser:
    """A parser of one answer's Qwen3-Coder calls."""
    return BlockToolParser(_SYNTAX, tools)


#: Qwen3-Coder's format, an entry of the registry.
QWEN3_CODER = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=parser,
    grammar=grammar,
    markers=(OPEN, CLOSE, "<function=", "<parameter="),
)
