"""Mistral's tool-call formats: ``[TOOL_CALLS]`` then a JSON list, or (v11
tokenizers) ``[TOOL_CALLS]NAME[ARGS]{...}`` per call.

Any thread, pure Python. Mistral-7B-v0.3, Mixtral and Ministral-8B write
the list; Mistral-Small-3.x, Devstral and Magistral one marker per call.
Detected by mlx-vlm. A block ends here where its JSON value ends: mlx-vlm
ends one at a newline, which cuts JSON that spans lines and joins two v11
calls on one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .base import ToolCallFormat, ToolSpec, json_arguments
from .blocks import Markers, grammar_of_calls, json_end, literal
from .vlm import Decoded, arguments_text, vlm_decoder, vlm_detects

__all__ = ["MISTRAL", "MISTRAL_V11", "decode", "list_grammar", "v11_grammar"]

OPEN = "[TOOL_CALLS]"
ARGS = "[ARGS]"


_VLM_DECODE = vlm_decoder("mistral")


def decode(body: str, tools: Sequence[ToolSpec]) -> list[Decoded]:
    """The calls of one block: a v11 one by mlx-vlm's parser; a JSON list
    here, since mlx-vlm tries the v11 pattern on it first, which misreads
    a string argument holding ``[ARGS]``."""
    text = body.strip()
    if not text.startswith(("[", "{")):
        return _VLM_DECODE(body, tools)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError("not a call: no JSON") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ValueError("not a call: no name")
    return [(str(c["name"]), arguments_text(c.get("arguments", {}))) for c in calls]


class _JSONBlocks(Markers):
    """A block from ``[TOOL_CALLS]`` to the end of its JSON value."""

    open_ended = True  # the turn may end right after the JSON

    def __init__(self) -> None:
        super().__init__(OPEN, "", decode)

    def end(self, body: str) -> tuple[int, int] | None:
        at = len(body) - len(body.lstrip())
        if not body[at:]:
            return None
        if body[at] in "[{":  # the JSON list (or one object)
            found = json_end(body, at)
        else:
            args = body.find(ARGS)
            if args < 0:  # the name, until '[ARGS]'
                return None
            found = json_end(body, args + len(ARGS))
        return None if found is None else (found, found)


_SYNTAX = _JSONBlocks()


def detect_v11(template: str) -> bool:
    """Whether a chat template writes v11 calls, ``NAME[ARGS]{...}``."""
    return vlm_detects("mistral")(template) and ARGS in template


def _v11_call(i: int, tool: ToolSpec) -> list[str]:
    schema = json.dumps(json_arguments(tool.parameters))
    return [
        f"call_{i}: {literal(OPEN + tool.name + ARGS)} args_{i}",
        f"args_{i}: %json {schema}",
    ]


def v11_grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    return grammar_of_calls(tools, parallel, _v11_call)


def _list_call(i: int, tool: ToolSpec) -> list[str]:
    schema = json.dumps(json_arguments(tool.parameters))
    head = literal(f'{{"name": "{tool.name}", "arguments": ')
    return [f"call_{i}: {head} args_{i} " + '"}"', f"args_{i}: %json {schema}"]


def list_grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """``[TOOL_CALLS] [``, a space apart as the template writes it, so the
    call sent back renders as the model wrote it."""
    return grammar_of_calls(
        tools, parallel, _list_call, before=f"{OPEN} [", between=", ", after="]"
    )


MISTRAL_V11 = ToolCallFormat(
    name="mistral_v11",
    detect=detect_v11,
    parser=_SYNTAX.parser,
    grammar=v11_grammar,
    markers=(OPEN, ARGS),
)

MISTRAL = ToolCallFormat(
    name="mistral",
    detect=vlm_detects("mistral"),
    parser=_SYNTAX.parser,
    grammar=list_grammar,
    markers=(OPEN,),
)
