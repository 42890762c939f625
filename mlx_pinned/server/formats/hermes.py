"""Hermes' tool-call format: ``<tool_call>`` JSON ``</tool_call>``.

Any thread, pure Python. Qwen2.5, Qwen3, Qwen3-VL, Hermes and the models
tuned on them write ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n
</tool_call>``. Unlike the block formats, :class:`HermesToolParser` streams
a call's arguments in fragments (the ``ARGS`` text as written) as soon as
they are certain.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence

from .base import (
    CallArguments,
    CallStart,
    Piece,
    ToolCallFormat,
    ToolSpec,
    after_call,
    json_arguments,
    partial_marker,
)
from .blocks import grammar_of_calls, literal

__all__ = ["HERMES", "HermesToolParser", "grammar"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# What comes before the arguments; committed only once the first character of
# the arguments is there (never '<', which begins the closing tag), so more
# whitespace after it cannot change the match.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"'
    r'\s*,\s*"arguments"\s*:\s*(?=[^\s<])'
)


def detect(template: str) -> bool:
    """Whether a chat template writes Hermes' calls."""
    return TOOL_CALL_OPEN in template


def _call(i: int, tool: ToolSpec) -> list[str]:
    head = literal(f'{TOOL_CALL_OPEN}\n{{"name": "{tool.name}", "arguments": ')
    tail = literal("}\n" + TOOL_CALL_CLOSE)
    schema = json.dumps(json_arguments(tool.parameters))
    return [f"call_{i}: {head} args_{i} {tail}", f"args_{i}: %json {schema}"]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    return grammar_of_calls(tools, parallel, _call, between="\n")


class _State(enum.Enum):
    TEXT = "text"  # content, outside any call
    HEAD = "head"  # inside <tool_call>, before the arguments
    ARGUMENTS = "arguments"  # inside a call's arguments


def _arguments(text: str) -> str:
    """What follows a call's head, without the object's closing brace."""
    text = text.rstrip()
    return text.removesuffix("}").rstrip()


class HermesToolParser:
    """A :class:`~.base.ToolCallParser` for Hermes' calls (``tools`` is
    unused: the arguments are JSON as written).

    Whitespace next to a call is dropped from the content; a closed
    ``<tool_call>`` block that is no call stays content. The end of the text
    closes a call cut short in its arguments, and drops one cut before them.
    """

    def __init__(self, tools: Sequence[ToolSpec] = ()) -> None:
        self._state = _State.TEXT
        self._buffer = ""  # text not yet given out
        self._lead = False  # content right after a call: drop its whitespace
        self._sent = ""  # the current call's arguments given out so far
        self._gap = ""  # whitespace before the current <tool_call>
        self._cut = False  # the answer was cut short
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._parse(final=False)

    def end(self, *, cut: bool = False) -> list[Piece]:
        self._cut = cut
        return self._parse(final=True)

    def _parse(self, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._state is _State.TEXT:
                if not self._text(out, final=final):
                    return out
            elif self._state is _State.HEAD:
                if not self._head(out, final=final):
                    return out
            elif not self._arguments_piece(out, final=final):
                return out

    def _content(self, out: list[Piece], text: str) -> None:
        text, self._lead = after_call(text, self._lead)
        if text:
            out.append(text)

    def _text(self, out: list[Piece], *, final: bool) -> bool:
        text = self._buffer
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            before = text[:start].rstrip()
            self._content(out, before)
            self._gap = text[len(before) : start]  # back in, if no call follows
            self._buffer = text[start + len(TOOL_CALL_OPEN) :]
            self._state = _State.HEAD
            return True
        if final:
            begun = partial_marker(text, TOOL_CALL_OPEN) if self._cut else 0
            if begun:  # a call may have begun: its markup goes, as a call's
                text = text[: len(text) - begun].rstrip()
            # Whitespace at the end goes with the calls, if any were made.
            self._content(out, text.rstrip() if self.calls else text)
            self._buffer = ""
            return False
        # Hold a possible start of <tool_call>, and the whitespace before it.
        keep = len(text) - partial_marker(text, TOOL_CALL_OPEN)
        keep = len(text[:keep].rstrip())
        self._content(out, text[:keep])
        self._buffer = text[keep:]
        return False

    def _head(self, out: list[Piece], *, final: bool) -> bool:
        close = self._buffer.find(TOOL_CALL_CLOSE)
        body = self._buffer if close < 0 else self._buffer[:close]
        head = _HEAD.match(body)
        if head is not None:
            name = json.loads(f'"{head.group(1)}"')
            out.append(CallStart(self.calls, name))
            self._buffer = self._buffer[head.end() :]
            self._state, self._sent = _State.ARGUMENTS, ""
            return True
        if close < 0:
            if final:  # a call cut before its arguments: no content either
                self._buffer, self._state = "", _State.TEXT
            return final  # else the head may still come
        # A closed block that is no call goes back to the content, markers
        # and all.
        rest = self._buffer[close + len(TOOL_CALL_CLOSE) :]
        self._content(out, self._gap + TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
        self._buffer, self._state = rest, _State.TEXT
        return True

    def _arguments_piece(self, out: list[Piece], *, final: bool) -> bool:
        close = self._buffer.find(TOOL_CALL_CLOSE)
        if close >= 0 or final:
            held = 0 if close >= 0 else partial_marker(self._buffer, TOOL_CALL_CLOSE)
            body = self._buffer[: close if close >= 0 else len(self._buffer) - held]
            arguments = _arguments(body)
            rest = "" if close < 0 else self._buffer[close + len(TOOL_CALL_CLOSE) :]
            self._buffer, self._state, self._lead = rest, _State.TEXT, True
        else:
            held = partial_marker(self._buffer, TOOL_CALL_CLOSE)
            arguments = _arguments(self._buffer[: len(self._buffer) - held])
        assert arguments.startswith(self._sent), "arguments only grow"
        if len(arguments) > len(self._sent):
            out.append(CallArguments(self.calls, arguments[len(self._sent) :]))
            self._sent = arguments
        if self._state is _State.TEXT:
            self.calls += 1
            return True
        return False


HERMES = ToolCallFormat(
    name="hermes",
    detect=detect,
    parser=HermesToolParser,
    grammar=grammar,
    markers=(TOOL_CALL_OPEN, TOOL_CALL_CLOSE),
)
