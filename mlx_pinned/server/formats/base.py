"""What a tool-call format and a reasoning format are: data, with their parsers.

Any thread, pure Python (the HTTP side uses it on the event loop). A format
is a frozen record of callables: how to recognise it in a chat template,
a parser for one answer (fed piece by piece, or the whole text at once:
both give the same parts), and, for tool calls, the grammar that forces a
call. Nothing here imports MLX or a web library.
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
    """A tool call begins: its index in the answer and its function name.
    ``id`` is empty from a parser; the answer gives each call its id."""

    index: int
    name: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class CallArguments:
    """A fragment of a tool call's arguments (JSON text)."""

    index: int
    text: str


#: What a tool-call parser gives: content (a plain string) or a call's parts.
Piece = str | CallStart | CallArguments


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool a forced call may call: its name and its arguments' JSON
    schema (None: any object)."""

    name: str
    parameters: Mapping[str, Any] | None = None


class ToolCallParser(Protocol):
    """Content and tool calls from one answer's text, fed piece by piece.

    Text inside a call never comes out as content, and neither does a call
    cut before its name and arguments.
    """

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
    """Makes a format's parser for one answer to a request with ``tools``
    (some formats read their arguments' types from the tools' schemas)."""

    def __call__(self, tools: Sequence[ToolSpec] = ()) -> ToolCallParser: ...


class UnforcedCallError(ValueError):
    """A format cannot force a call to these tools (a grammar of its syntax
    cannot hold their arguments' schemas): the message says which and why."""


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
        parser: A parser for one answer (given the request's tools).
        grammar: A Lark grammar that forces calls to ``tools``, each one's
            arguments valid for its schema: ``grammar(tools, parallel)``
            allows one call then the end, or with ``parallel`` one or more
            (at most :data:`.blocks.MAX_FORCED_CALLS`);
            it raises :class:`UnforcedCallError` for tools whose arguments
            the format's syntax cannot be forced to hold.
        markers: The markup its calls are written in (openings, closings,
            separators): text a parsed call leaves in no content field.
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
        detect: Whether a chat template thinks in this format.
        opens: Whether the template's generation prompt opens the
            reasoning itself, given the request's template arguments
            (``opens(template, kwargs)``): then the answer starts inside it.
        parser: A parser for one answer; its argument says whether the
            answer starts inside the reasoning.
        markers: ``(opening, closing)``, the text that opens and closes the
            reasoning as the model writes it (what a thinking budget
            forces); None: the format has no closing marker to force.
    """

    name: str
    detect: Callable[[str], bool]
    opens: Callable[[str, Mapping[str, Any]], bool]
    parser: Callable[[bool], ReasoningParser]
    markers: tuple[str, str] | None = None

    def budget_markers(
        self, template: str, template_kwargs: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """The markers a thinking budget counts from and forces, for an
        answer to this template: the opening is empty when the generation
        prompt opens the reasoning (the answer starts inside it)."""
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


# Tool arguments in a forced call are written as Qwen's template writes them
# (json.dumps' separators, no other whitespace), so a model (above all a
# random one) cannot spend its tokens on blank space. A schema's own
# x-guidance wins.
_JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Any object: what a tool without 'parameters' takes.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_arguments(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The JSON schema (with llguidance's layout) a forced call's arguments
    follow, in a format that writes them as JSON."""
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
