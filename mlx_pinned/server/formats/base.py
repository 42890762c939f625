"""What a tool-call format and a reasoning format are: frozen records of
callables (detection, parsers, grammar). Any thread, pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "CallArguments",
    "CallStart",
    "Piece",
    "ReasoningFormat",
    "ReasoningParser",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolParserFactory",
    "ToolSpec",
    "UnforcedCallError",
    "after_call",
    "json_arguments",
    "partial_marker",
]


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call begins. ``id`` is empty from a parser; the answer gives
    each call its id."""

    index: int
    name: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class CallArguments:
    """A fragment of a tool call's arguments (JSON text)."""

    index: int
    text: str


Piece = str | CallStart | CallArguments


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool a forced call may call: its name and its arguments' JSON
    schema (None: any object)."""

    name: str
    parameters: Mapping[str, Any] | None = None


class ToolCallParser(Protocol):
    """Content and tool calls from one answer's text, fed piece by piece
    (or whole: both give the same parts). Text inside a call never comes
    out as content, and neither does a call cut before its arguments."""

    @property
    def calls(self) -> int:
        """Complete calls so far (all of them once :meth:`end` was called)."""

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` releases, in order (text that may begin a
        call is held until it is clear)."""

    def end(self, *, cut: bool = False) -> list[Piece]:
        """Everything still held, at the end of the answer; ``cut``: the
        answer was cut short (``max_tokens``), so text at its end that may
        begin a call is markup too, and is dropped."""


class ToolParserFactory(Protocol):
    """A parser for one answer (some formats read argument types from the
    tools' schemas)."""

    def __call__(self, tools: Sequence[ToolSpec] = ()) -> ToolCallParser: ...


class UnforcedCallError(ValueError):
    """A format's syntax cannot hold these tools' argument schemas; the
    message says which and why."""


class ReasoningParser(Protocol):
    """Reasoning and content from one answer's text, fed piece by piece."""

    @property
    def thought(self) -> bool:
        """Whether any reasoning began."""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content ``text`` releases."""

    def end(self) -> tuple[str, str]:
        """What is still held, at the end of the answer."""


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How a model family writes tool calls.

    Attributes:
        name: What ``--tool-call-parser`` calls it.
        detect: Whether a chat template writes calls in this format.
        grammar: ``grammar(tools, parallel)``, a Lark grammar that forces one
            call (with ``parallel``, up to :data:`.blocks.MAX_FORCED_CALLS`)
            to ``tools``, arguments valid for their schemas; raises
            :class:`UnforcedCallError` where the syntax cannot hold them.
        markers: The markup its calls are written in: text a parsed call
            leaves in no content field.
    """

    name: str
    detect: Callable[[str], bool]
    parser: ToolParserFactory
    grammar: Callable[[Sequence[ToolSpec], bool], str]
    markers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How a model family writes its reasoning before its answer.

    Attributes:
        name: What ``--reasoning-parser`` calls it.
        opens: ``opens(template, kwargs)``: whether the generation prompt
            opens the reasoning itself, so the answer starts inside it.
        parser: A parser for one answer, told whether it starts inside.
        markers: ``(opening, closing)`` as the model writes them (what a
            thinking budget forces); None: no closing marker to force.
    """

    name: str
    detect: Callable[[str], bool]
    opens: Callable[[str, Mapping[str, Any]], bool]
    parser: Callable[[bool], ReasoningParser]
    markers: tuple[str, str] | None = None

    def budget_markers(
        self, template: str, template_kwargs: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """The markers a thinking budget counts from and forces; the
        opening is empty when the generation prompt opens the reasoning."""
        if self.markers is None:
            return None
        opening, closing = self.markers
        return ("" if self.opens(template, template_kwargs) else opening), closing


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (and is
    shorter than it): text to hold back until the next piece says more."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


# Forced arguments as json.dumps writes them, so a model cannot spend its
# tokens on blank space; a schema's own x-guidance wins.
_JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_arguments(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The schema, with llguidance's layout, of forced JSON arguments."""
    schema = dict(parameters or _ANY_OBJECT)
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": _JSON_STYLE}


def after_call(text: str, lead: bool) -> tuple[str, bool]:
    """``text`` as content; with ``lead`` (it follows a call) without its
    leading whitespace. Also whether the text after it still follows one."""
    if lead:
        text = text.lstrip()
        lead = not text
    return text, lead
