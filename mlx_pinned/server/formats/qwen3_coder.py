"""Qwen3-Coder's tool-call format: XML functions and parameters.

Any thread, pure Python. Qwen3-Coder and Qwen3.5 write
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
</function>\\n</tool_call>``, a value raw and typed by the tool's schema.
Detected and decoded by mlx-vlm.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import ToolCallFormat, ToolSpec
from .blocks import (
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
    """Each parameter in the schema's order, the required ones always."""
    return grammar_of_calls(tools, parallel, _call, between="\n")


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


QWEN3_CODER = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=_SYNTAX.parser,
    grammar=grammar,
    markers=(OPEN, CLOSE, "<function=", "<parameter="),
)
