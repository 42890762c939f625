"""The pythonic tool-call format: a Python list of calls with keyword arguments.

Any thread, pure Python. LFM2 and the models tuned like it write
``<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>``.
Detected and decoded by mlx-vlm; the grammar writes values as Python
literals through :mod:`.literals`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import ToolCallFormat, ToolSpec
from .blocks import Markers, grammar_of_calls, literal, property_items
from .literals import LiteralSyntax, value_rules
from .vlm import vlm_decoder, vlm_detects

__all__ = ["PYTHONIC", "grammar"]

NAME = "pythonic"
OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"


SYNTAX = LiteralSyntax(
    format=NAME,
    quote='"',
    unquoted='^"\\\\\\n',
    true="True",
    false="False",
    null="None",
    separator=", ",
    key_format='"{key}": ',
    any_key='/"[^"\\\\\\n]*"/ ": "',
)


def _call(i: int, tool: ToolSpec) -> list[str]:
    rules, arguments = [], []
    for k, (key, schema, required) in enumerate(property_items(tool.parameters)):
        if required:
            rules += value_rules(SYNTAX, tool.name, key, schema, f"value_{i}_{k}")
            arguments.append(f"{literal(key + '=')} value_{i}_{k}")
    inner = ' ", " '.join(arguments)
    return [f"call_{i}: {literal(tool.name + '(')} {inner} " + '")"', *rules]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """Each call with its required arguments, in order."""
    return grammar_of_calls(
        tools, parallel, _call, before=f"{OPEN}[", between=", ", after=f"]{CLOSE}"
    )


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


PYTHONIC = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=_SYNTAX.parser,
    grammar=grammar,
    markers=(OPEN, CLOSE),
)
