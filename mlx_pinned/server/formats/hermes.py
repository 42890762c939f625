"""Hermes' tool-call format: ``<tool_call>`` JSON ``</tool_call>``.

Any thread, pure Python. Qwen2.5, Qwen3, Qwen3-VL, Hermes and the models
tuned on them write each call as
``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``; a chat
template that contains ``<tool_call>`` has this format.

:class:`HermesToolParser` reads the text piece by piece and gives content,
then each call's start (its name) and its arguments in fragments, as soon
as they are certain; fed the whole text at once it gives the same calls,
so a stream and a whole answer agree exactly (a test checks it). A call's
arguments are its ``ARGS`` text as the model wrote it. :func:`grammar`
forces calls in this format.
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
    """A Lark grammar for one call (or, with ``parallel``, one or more, a
    newline apart) to one of ``tools``, its arguments constrained by the
    tool's ``parameters`` schema."""
    return grammar_of_calls(tools, parallel, _call, between="\n")


class _State(enum.Enum):
    TEXT = "text"  # content, outside any call
    HEAD = "head"  # inside <tool_call>, before the arguments
    ARGUMENTS = "arguments"  # inside a call's arguments


def _arguments(text: str) -> str:
    """A call's arguments from what follows its head: without the object's
    closing brace and the whitespace around it."""
    text = text.rstrip()
    return text.removesuffix("}").rstrip()


class HermesToolParser:
    """Content and tool calls from Hermes-format text, fed piece by piece.

    Whitespace next to a call is dropped from the content (Qwen writes a
    newline between calls); a closed ``<tool_call>`` block that is not a
    call (no name and arguments) stays content. The end of the text closes
    a call cut short in its arguments, and drops one cut before them.

    Args:
        tools: The request's tools (unused: the arguments are JSON as written).
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
        """The content and call pieces ``text`` releases, in order."""
        self._buffer += text
        return self._parse(final=False)

    def end(self, *, cut: bool = False) -> list[Piece]:
        """Everything still held, at the end of the answer; one ``cut``
        short drops a possible start of a call at its end too."""
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


#: Hermes' format, an entry of the registry.
HERMES = ToolCallFormat(
    name="hermes",
    detect=detect,
    parser=HermesToolParser,
    grammar=grammar,
    markers=(TOOL_CALL_OPEN, TOOL_CALL_CLOSE),
)
