"""DeepSeek V3's tool-call formats: a section of calls between special tokens.

Any thread, pure Python. Written with plain bars for DeepSeek's full-width
ones, V3 and R1 write ``<|tool calls begin|><|tool call begin|>function
<|tool sep|>NAME\\n```json\\n{...}\\n```<|tool call end|>...<|tool calls
end|>``; V3.1 and later drop the type and the fence. mlx-vlm has no parser
for either: a section is read whole here, each call in either layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from .base import ToolCallFormat, ToolSpec, json_arguments
from .blocks import Markers, grammar_of_calls, literal
from .vlm import Decoded, arguments_text

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V31", "decode", "v3_grammar", "v31_grammar"]


def _token(*words: str) -> str:
    """A DeepSeek special token: its words between full-width bars."""
    return "<\uff5c" + "\u2581".join(words) + "\uff5c>"


OPEN, CLOSE = _token("tool", "calls", "begin"), _token("tool", "calls", "end")
CALL_OPEN, CALL_CLOSE = _token("tool", "call", "begin"), _token("tool", "call", "end")
SEP = _token("tool", "sep")
FENCE = "```json"
_CALL = re.compile(
    re.escape(CALL_OPEN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_CLOSE),
    re.S,
)
_FENCED = re.compile(r"\s*([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.S)


def detect_v3(template: str) -> bool:
    """Whether a chat template writes V3's calls (type, name and fence)."""
    return OPEN in template and FENCE in template


def detect_v31(template: str) -> bool:
    """Whether a chat template writes V3.1's calls (name and JSON)."""
    return OPEN in template and FENCE not in template


def decode(body: str, tools: Sequence[ToolSpec]) -> list[Decoded]:
    """The calls of one section; ValueError if it holds none."""
    calls = []
    for head, rest in _CALL.findall(body):
        fenced = _FENCED.fullmatch(rest) if head.strip() == "function" else None
        name, arguments = (fenced[1], fenced[2]) if fenced else (head, rest)
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError("not a call: arguments are no JSON") from None
        calls.append((name.strip(), arguments_text(value)))
    if not calls:
        raise ValueError("not a call: no calls in the section")
    return calls


def _v3_call(i: int, tool: ToolSpec) -> list[str]:
    head = literal(f"{CALL_OPEN}function{SEP}{tool.name}\n{FENCE}\n")
    schema = json.dumps(json_arguments(tool.parameters))
    tail = literal(f"\n```{CALL_CLOSE}")
    return [f"call_{i}: {head} args_{i} {tail}", f"args_{i}: %json {schema}"]


def _v31_call(i: int, tool: ToolSpec) -> list[str]:
    head = literal(f"{CALL_OPEN}{tool.name}{SEP}")
    schema = json.dumps(json_arguments(tool.parameters))
    tail = literal(CALL_CLOSE)
    return [f"call_{i}: {head} args_{i} {tail}", f"args_{i}: %json {schema}"]


def v3_grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    return grammar_of_calls(tools, parallel, _v3_call, before=OPEN, after=CLOSE)


def v31_grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    return grammar_of_calls(tools, parallel, _v31_call, before=OPEN, after=CLOSE)


_SYNTAX = Markers(OPEN, CLOSE, decode)


DEEPSEEK_V3 = ToolCallFormat(
    name="deepseek_v3",
    detect=detect_v3,
    parser=_SYNTAX.parser,
    grammar=v3_grammar,
    markers=(OPEN, CLOSE, CALL_OPEN, CALL_CLOSE, SEP),
)

DEEPSEEK_V31 = ToolCallFormat(
    name="deepseek_v31",
    detect=detect_v31,
    parser=_SYNTAX.parser,
    grammar=v31_grammar,
    markers=(OPEN, CLOSE, CALL_OPEN, CALL_CLOSE, SEP),
)
