"""Kimi K2's tool-call format: a section of calls between special tokens.

Any thread, pure Python. Per call, ``<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>{...}<|tool_call_end|>``, inside one section.
Detected and decoded (a section at a time) by mlx-vlm.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .base import ToolCallFormat, ToolSpec, json_arguments
from .blocks import Markers, grammar_of_calls, literal
from .vlm import vlm_decoder, vlm_detects

__all__ = ["KIMI_K2", "grammar"]

NAME = "kimi_k2"
OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def _call(i: int, tool: ToolSpec) -> list[str]:
    head = literal(f"<|tool_call_begin|>functions.{tool.name}:")
    schema = json.dumps(json_arguments(tool.parameters))
    return [
        f"call_{i}: {head} /[0-9]/ {literal('<|tool_call_argument_begin|>')} "
        f"args_{i} {literal('<|tool_call_end|>')}",
        f"args_{i}: %json {schema}",
    ]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    return grammar_of_calls(tools, parallel, _call, before=OPEN, after=CLOSE)


_SYNTAX = Markers(OPEN, CLOSE, vlm_decoder(NAME))


KIMI_K2 = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=_SYNTAX.parser,
    grammar=grammar,
    markers=(
        OPEN,
        CLOSE,
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
)
