"""GLM-4.5 to 4.7's tool-call format: keys and values inside ``<tool_call>``.

Any thread, pure Python. A call is ``<tool_call>NAME<arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>...</tool_call>``, a string value raw, any other
JSON. Detected and decoded by mlx-vlm; the grammar writes calls as GLM-4.7
does (4.5 and 4.6 put newlines between the parts).
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

__all__ = ["GLM47", "grammar"]

NAME = "glm47"
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call(i: int, tool: ToolSpec) -> list[str]:
    params, rules = [], []
    for k, (key, schema, required) in enumerate(property_items(tool.parameters)):
        rules.append(f"value_{i}_{k}: {raw_value(NAME, tool.name, key, schema)}")
        head = literal(f"<arg_key>{key}</arg_key><arg_value>")
        rules.append(f'param_{i}_{k}: {head} value_{i}_{k} "</arg_value>"')
        params.append(f"param_{i}_{k}" + ("" if required else "?"))
    head, tail = literal(OPEN + tool.name), literal(CLOSE)
    return [f"call_{i}: {head} {' '.join(params)} {tail}", *rules]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """Each argument in the schema's order, the required ones always."""
    return grammar_of_calls(tools, parallel, _call)


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


GLM47 = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=_SYNTAX.parser,
    grammar=grammar,
    markers=(OPEN, CLOSE, "<arg_key>", "<arg_value>"),
)
