"""The pythonic tool-call format: a Python list of calls with keyword arguments.

Any thread, pure Python. LFM2 and the models tuned like it write
``<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>``
(several calls in the one list, the list Llama 4's pythonic prompts ask
for). Detected by mlx-vlm (``pythonic``: the template names
``<|tool_call_start|>`` and ``<|tool_call_end|>``, or
``<|tool_list_start|>``); decoded by mlx-vlm's parser (Python literals,
read with ``ast``).
:func:`grammar` forces each value as a Python literal (lists, dicts,
``True``, ``None``: :mod:`.literals`), not JSON; a string with a
``pattern`` or ``format`` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import ToolCallFormat, ToolCallParser, ToolSpec
from .blocks import BlockToolParser, Markers, grammar_of_calls, literal, property_items
from .literals import LiteralSyntax, value_rules
from .vlm import vlm_decoder, vlm_detects

__all__ = ["PYTHONIC", "grammar"]

NAME = "pythonic"
OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"


#: Python literals, as the calls write their values.
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
