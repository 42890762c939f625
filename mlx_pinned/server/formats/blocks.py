"""Tool calls written as blocks: one streaming parser for every format whose
calls are whole spans of markup, each decoded once complete (so any cut of
the text gives the same parts), and the helpers their grammars share.
Any thread, pure Python.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Sequence
from typing import Any

from .base import (
    CallArguments,
    CallStart,
    Piece,
    ToolSpec,
    UnforcedCallError,
    after_call,
    partial_marker,
)
from .vlm import Decoded

__all__ = [
    "MAX_FORCED_CALLS",
    "BlockToolParser",
    "CallSyntax",
    "Decoder",
    "Markers",
    "grammar_of_calls",
    "json_end",
    "literal",
    "property_items",
    "raw_value",
]

#: Decodes a block's body into its calls; raises ValueError if it is none.
Decoder = Callable[[str, Sequence[ToolSpec]], list[Decoded]]

_JSON = json.JSONDecoder()


class CallSyntax(abc.ABC):
    """Where a format's call blocks begin and end.

    Attributes:
        open_ended: A block left open at the end of the answer is decoded
            as it stands (its closing marker is a stop token, or it has
            none); else it is no call.
        loose: A block left open at the end of an uncut answer that is no
            call is content (its opening is ordinary text, such as Llama
            3's ``{``); else it is dropped, as markup.
    """

    open_ended = False
    loose = False

    def __init__(self, decode: Decoder) -> None:
        self.decode = decode

    def parser(self, tools: Sequence[ToolSpec] = ()) -> BlockToolParser:
        """A parser of one answer's calls, written in these blocks."""
        return BlockToolParser(self, tools)

    @abc.abstractmethod
    def start(self, text: str, *, first: bool) -> tuple[int, int] | None:
        """Where the first block in ``text`` begins: its markup's start and
        its body's start; None if none does. ``first``: nothing but
        whitespace came before ``text`` in the answer, or since a call."""

    @abc.abstractmethod
    def held(self, text: str, *, first: bool) -> int:
        """How much of the end of ``text`` may begin a block."""

    @abc.abstractmethod
    def end(self, body: str) -> tuple[int, int] | None:
        """Where the block whose body begins ``body`` ends: its body's end
        and its markup's end; None while that is not known."""


class Markers(CallSyntax):
    """A block between an opening (any of several) and a closing marker."""

    def __init__(self, opening: str | Sequence[str], closing: str, decode: Decoder):
        super().__init__(decode)
        self.openings = (opening,) if isinstance(opening, str) else tuple(opening)
        self.closing = closing

    def start(self, text: str, *, first: bool) -> tuple[int, int] | None:
        found = [(text.find(o), len(o)) for o in self.openings if o in text]
        if not found:
            return None
        begin, size = min(found)
        return begin, begin + size

    def held(self, text: str, *, first: bool) -> int:
        return max(partial_marker(text, o) for o in self.openings)

    def end(self, body: str) -> tuple[int, int] | None:
        close = body.find(self.closing)
        return None if close < 0 else (close, close + len(self.closing))


def json_end(text: str, at: int) -> int | None:
    """Where the JSON value at ``text[at:]`` (after whitespace) ends; None
    while it is incomplete or is no JSON."""
    at += len(text[at:]) - len(text[at:].lstrip())
    try:
        return _JSON.raw_decode(text, at)[1]
    except ValueError:
        return None


class BlockToolParser:
    """A :class:`~.base.ToolCallParser` over one :class:`CallSyntax`'s blocks.

    Whitespace next to a call is dropped from the content; a closed block
    that is no call stays content, markers and all.
    """

    def __init__(self, syntax: CallSyntax, tools: Sequence[ToolSpec] = ()) -> None:
        self._syntax = syntax
        self._tools = tools
        self._buffer = ""  # text not yet given out
        self._inside = False  # the buffer begins a block's body
        self._opening = ""  # the current block's opening markup
        self._gap = ""  # whitespace before it
        self._lead = False  # content right after a call: drop its whitespace
        self._first = True  # only whitespace so far, or since a call
        self._cut = False
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._parse(final=False)

    def end(self, *, cut: bool = False) -> list[Piece]:
        self._cut = cut
        return self._parse(final=True)

    def _parse(self, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._call(out, final=final) if self._inside else self._text(out, final):
            pass
        return out

    def _content(self, out: list[Piece], text: str) -> None:
        text, self._lead = after_call(text, self._lead)
        if text:
            out.append(text)
            self._first = self._first and not text.strip()

    def _text(self, out: list[Piece], final: bool) -> bool:
        text, syntax = self._buffer, self._syntax
        found = syntax.start(text, first=self._first)
        if found is not None:
            begin, body = found
            before = text[:begin].rstrip()
            self._content(out, before)
            self._gap, self._opening = text[len(before) : begin], text[begin:body]
            self._buffer, self._inside = text[body:], True
            return True
        if final:
            begun = syntax.held(text, first=self._first) if self._cut else 0
            if begun:  # a call may have begun: its markup goes, as a call's
                text = text[: len(text) - begun].rstrip()
            self._content(out, text.rstrip() if self.calls else text)
            self._buffer = ""
            return False
        # Hold a possible start of a block, and the whitespace before it.
        keep = len(text) - syntax.held(text, first=self._first)
        keep = len(text[:keep].rstrip())
        self._content(out, text[:keep])
        self._buffer = text[keep:]
        return False

    def _decoded(self, body: str) -> list[Decoded]:
        try:
            return self._syntax.decode(body, self._tools)
        except ValueError:
            return []

    def _call(self, out: list[Piece], *, final: bool) -> bool:
        found = self._syntax.end(self._buffer)
        if found is None:
            if not final:
                return False
            body, rest = self._buffer, ""
            calls = self._decoded(body) if self._syntax.open_ended else []
            if not calls and self._syntax.loose and not self._cut:
                self._content(out, self._gap + self._opening + body)
        else:
            body_end, markup_end = found
            body, rest = self._buffer[:body_end], self._buffer[markup_end:]
            calls = self._decoded(body)
            if not calls:  # no call: its text goes back to the content
                self._content(
                    out, self._gap + self._opening + self._buffer[:markup_end]
                )
        for name, arguments in calls:
            out.append(CallStart(self.calls, name))
            if arguments:
                out.append(CallArguments(self.calls, arguments))
            self.calls += 1
        if calls:
            self._lead, self._first = True, True
        self._buffer, self._inside = rest, False
        return True


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


#: The most calls a forced answer with parallel calls may hold: a model that
#: prefers the separator to the list's end would repeat calls forever.
MAX_FORCED_CALLS = 8


def grammar_of_calls(
    tools: Sequence[ToolSpec],
    parallel: bool,
    call: Callable[[int, ToolSpec], list[str]],
    *,
    before: str = "",
    between: str = "",
    after: str = "",
) -> str:
    """A Lark grammar of one call (with ``parallel``, up to
    :data:`MAX_FORCED_CALLS`, ``between`` apart) to one of ``tools``, inside
    ``before`` and ``after``; ``call(i, tool)`` gives a tool's rules, the
    first named ``call_{i}``."""
    rules: list[str] = []
    for i, tool in enumerate(tools):
        rules += call(i, tool)
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    sep = f"{literal(between)} " if between else ""
    more = f" ({sep}call){{0,{MAX_FORCED_CALLS - 1}}}" if parallel else ""
    head = f"{literal(before)} " if before else ""
    tail = f" {literal(after)}" if after else ""
    start = f"start: {head}call{more}{tail}"
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"


def property_items(parameters: Any) -> list[tuple[str, dict[str, Any], bool]]:
    """A schema's properties in order: name, schema, whether required."""
    if not isinstance(parameters, dict):
        return []
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    return [
        (key, value if isinstance(value, dict) else {}, key in required)
        for key, value in properties.items()
    ]


def _is_string(schema: dict[str, Any]) -> bool:
    if schema.get("type") == "string":
        return True
    values = schema.get("enum") or ()
    return bool(values) and all(isinstance(v, str) for v in values)


def raw_value(fmt: str, tool: str, key: str, schema: dict[str, Any]) -> str:
    """A Lark expression for an argument in a format that writes strings
    raw and other values as JSON; :class:`~.base.UnforcedCallError` for a
    string with a ``pattern`` or ``format``."""
    if not _is_string(schema):
        return f"%json {json.dumps(schema)}"
    if "enum" in schema:
        return " | ".join(literal(str(v)) for v in schema["enum"])
    if "pattern" in schema or "format" in schema:
        raise UnforcedCallError(
            f"The {fmt} tool-call format cannot force {tool}'s argument "
            f"{key!r}: it writes strings raw, so a 'pattern' or 'format' "
            "cannot be kept; use tool_choice 'auto'."
        )
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    count = f"{{{low},{high}}}" if high is not None else ("+" if low else "*")
    # No '<' (it would begin a closing tag) and no newline in a forced value.
    return f"/[^<\\n]{count}/"
