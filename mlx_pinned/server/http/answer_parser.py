"""The generated text as an answer's parts: reasoning, content and tool calls.

Event loop, the same for every API. A stream and a whole answer see the
same parts, so a stream's deltas join to exactly the whole answer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..formats import (
    CallArguments,
    CallStart,
    ReasoningParser,
    ToolCallParser,
)

if TYPE_CHECKING:
    from ..events import ChatFacts
    from .serving_common import Prepared

__all__ = [
    "AnswerParser",
    "Part",
    "Reasoning",
    "answer_parser",
    "arguments_object",
]


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


#: A part of the answer: reasoning, content (a plain string) or a tool call's
#: start or arguments.
Part = Reasoning | str | CallStart | CallArguments


class AnswerParser:
    """Splits generated text, fed piece by piece, into the parts of an
    answer; ``reasoning`` is None where the answer has none, ``tools`` where
    the request has no tools the model may call."""

    def __init__(
        self,
        *,
        reasoning: ReasoningParser | None,
        tools: ToolCallParser | None,
        call_id: Callable[[], str],
    ) -> None:
        self._splitter = reasoning
        self._tools = tools
        self._call_id = call_id

    @property
    def called(self) -> bool:
        """Whether the answer made a tool call (complete ones only, so all
        of them once :meth:`end` was called)."""
        return self._tools is not None and self._tools.calls > 0

    @property
    def thought(self) -> bool:
        return self._splitter is not None and self._splitter.thought

    def feed(self, text: str) -> list[Part]:
        if self._splitter is None:
            return self._content(text, final=False)
        reasoning, content = self._splitter.feed(text)
        return self._parts(reasoning, content, final=False)

    def end(self, *, cut: bool = False) -> list[Part]:
        """Every part still held, at the end of the answer (``cut``: by
        ``max_tokens``; the start of a call it cut is no content)."""
        if self._splitter is None:
            return self._content("", final=True, cut=cut)
        reasoning, content = self._splitter.end()
        return self._parts(reasoning, content, final=True, cut=cut)

    def _parts(
        self, reasoning: str, content: str, *, final: bool, cut: bool = False
    ) -> list[Part]:
        parts: list[Part] = [Reasoning(reasoning)] if reasoning else []
        return parts + self._content(content, final=final, cut=cut)

    def _content(self, text: str, *, final: bool, cut: bool = False) -> list[Part]:
        if self._tools is None:
            return [text] if text else []
        pieces = list(self._tools.feed(text)) if text else []
        if final:
            pieces += self._tools.end(cut=cut)
        # Each call gets its id here, where the answer is made.
        return [
            dataclasses.replace(piece, id=self._call_id())
            if isinstance(piece, CallStart)
            else piece
            for piece in pieces
        ]


def answer_parser(
    facts: ChatFacts, prepared: Prepared, call_id: Callable[[], str]
) -> AnswerParser | None:
    """The parser the answer of a ``prepared`` request needs; None when its
    text is its content. An answer under a grammar (it follows it from its
    first token) has no reasoning."""
    formats = facts.formats
    reasoning = None
    if formats.reasoning is not None and prepared.params.grammar is None:
        opened = formats.reasoning.opens(
            facts.chat_template or "", prepared.template_kwargs
        )
        reasoning = formats.reasoning.parser(opened)
    calls = None
    if formats.tool_call is not None and prepared.tools:
        calls = formats.tool_call.parser(prepared.tools)
    if reasoning is None and calls is None:
        return None
    return AnswerParser(reasoning=reasoning, tools=calls, call_id=call_id)


def arguments_object(text: str) -> dict[str, Any]:
    """A tool call's arguments as an object (the APIs that send them parsed);
    arguments that are no JSON object (a free answer's broken call) are kept
    under ``_raw``, so nothing the model wrote is lost."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_raw": text}
