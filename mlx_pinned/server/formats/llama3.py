"""Llama 3's tool-call format: a JSON object, ``{"name": ..., "parameters": ...}``.

Any thread, pure Python. Llama 3.1 to 3.3 (and Llama 4 with its JSON
template) answer a call as the whole turn, several ``; `` apart, or after
``<|python_tag|>``. mlx-vlm has no parser for it: here a call is a JSON
object at the start of the answer (or after a call or the tag), read whole;
one with no ``name`` or ``parameters`` stays content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from .base import (
    ToolCallFormat,
    ToolSpec,
    json_arguments,
    partial_marker,
)
from .blocks import CallSyntax, grammar_of_calls, json_end, literal
from .vlm import Decoded, arguments_text

__all__ = ["LLAMA3_JSON", "decode", "detect", "grammar"]

PYTHON_TAG = "<|python_tag|>"
_HEADERS = ("<|start_header_id|>", "<|header_start|>")
# A call's JSON object, perhaps after the '; ' that parts two calls.
_LEADING = re.compile(r"\s*(;\s*)?(?=\{)")
_BEGUN = re.compile(r"\s*(;\s*)?")


def detect(template: str) -> bool:
    """Whether a chat template writes Llama 3's JSON calls."""
    return '"parameters": ' in template and any(h in template for h in _HEADERS)


def decode(body: str, tools: Sequence[ToolSpec]) -> list[Decoded]:
    """The call of one JSON object; ValueError if it is none."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        raise ValueError("not a call: no JSON") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("not a call: no name")
    arguments = call.get("parameters", call.get("arguments"))
    if not isinstance(arguments, dict | str):
        raise ValueError("not a call: no parameters")
    return [(call["name"], arguments_text(arguments))]


class _Objects(CallSyntax):
    open_ended = True  # the call is the whole turn
    loose = True  # '{' is ordinary text too

    def start(self, text: str, *, first: bool) -> tuple[int, int] | None:
        found = []
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            found.append((tag, tag + len(PYTHON_TAG)))
        leading = _LEADING.match(text) if first else None
        if leading is not None:
            begin = leading.start(1) if leading.group(1) else leading.end()
            found.append((begin, leading.end()))
        return min(found) if found else None

    def held(self, text: str, *, first: bool) -> int:
        if first and _BEGUN.fullmatch(text):
            return len(text)
        return partial_marker(text, PYTHON_TAG)

    def end(self, body: str) -> tuple[int, int] | None:
        found = json_end(body, 0)
        return None if found is None else (found, found)


_SYNTAX = _Objects(decode)


def _call(i: int, tool: ToolSpec) -> list[str]:
    head = literal(f'{{"name": "{tool.name}", "parameters": ')
    schema = json.dumps(json_arguments(tool.parameters))
    return [f"call_{i}: {head} args_{i} " + '"}"', f"args_{i}: %json {schema}"]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    return grammar_of_calls(tools, parallel, _call, between="; ")


LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    detect=detect,
    parser=_SYNTAX.parser,
    grammar=grammar,
    markers=(PYTHON_TAG, '"parameters": '),
)
