"""The generated text as OpenAI's answer: reasoning, content and tool calls.

Event loop, pure Python. :class:`AnswerParser` runs the generated text
through the model's reasoning format's parser (for a model that thinks) and
its tool-call format's parser (for a request with tools), piece by piece; a
stream turns each part into a delta (:func:`delta`), a whole answer collects
them (:class:`Answer`). Both see the same parts, so a stream's deltas join
to exactly the whole answer. A request with neither needs no parser: its
text is its content, as generated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..events import FinishReason
from ..formats import (
    CallArguments,
    CallStart,
    ModelFormats,
    ReasoningParser,
    ToolCallParser,
)
from .chat_completions.protocol import ChatCompletionRequest
from .chat_completions.responses import (
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ResponseMessage,
    ResponseToolCall,
    WireFinishReason,
    tool_call_id,
)

__all__ = [
    "Answer",
    "AnswerParser",
    "Part",
    "Reasoning",
    "answer_parser",
    "delta",
]


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A piece of the model's reasoning."""

    text: str


#: A part of the answer: reasoning, content (a plain string) or a tool call's
#: start or arguments.
Part = Reasoning | str | CallStart | CallArguments


class AnswerParser:
    """Splits generated text, fed piece by piece, into the parts of an answer.

    Args:
        reasoning: The parser of the model's reasoning (None: it does not
            think, or not in this answer).
        tools: The parser of its tool calls (None: the request has no tools
            the model may call).
    """

    def __init__(
        self, *, reasoning: ReasoningParser | None, tools: ToolCallParser | None
    ) -> None:
        self._splitter = reasoning
        self._tools = tools

    @property
    def called(self) -> bool:
        """Whether the answer made a tool call (complete ones only, so all
        of them once :meth:`end` was called)."""
        return self._tools is not None and self._tools.calls > 0

    @property
    def thought(self) -> bool:
        """Whether the answer began any reasoning."""
        return self._splitter is not None and self._splitter.thought

    def feed(self, text: str) -> list[Part]:
        """The parts ``text`` releases, in order."""
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
            dataclasses.replace(piece, id=tool_call_id())
            if isinstance(piece, CallStart)
            else piece
            for piece in pieces
        ]


def answer_parser(
    request: ChatCompletionRequest,
    template: str | None,
    formats: ModelFormats,
    *,
    constrained: bool,
) -> AnswerParser | None:
    """The parser a request's answer needs; None when its text is its content.

    The model's reasoning format and its chat ``template`` say whether and
    how it thinks; tool calls are parsed in its tool-call format when the
    request gives tools the model may call. A ``constrained`` answer (it
    follows a grammar from its first token) has no reasoning.
    """
    reasoning = None
    if formats.reasoning is not None and not constrained:
        kwargs = request.chat_template_kwargs or {}
        opened = formats.reasoning.opens(template or "", kwargs)
        reasoning = formats.reasoning.parser(opened)
    tools = None
    if formats.tool_call is not None and request.active_tools:
        tools = formats.tool_call.parser()
    if reasoning is None and tools is None:
        return None
    return AnswerParser(reasoning=reasoning, tools=tools)


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


@dataclass
class Answer:
    """The parts of a whole answer, collected into its message."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    thought: bool = False

    def add(self, parts: list[Part]) -> None:
        for part in parts:
            if isinstance(part, Reasoning):
                self.reasoning.append(part.text)
            elif isinstance(part, str):
                self.content.append(part)
            elif isinstance(part, CallStart):
                self.calls.append(_Call(part.id, part.name))
            else:
                self.calls[part.index].arguments.append(part.text)

    def message(self) -> ResponseMessage:
        content = "".join(self.content)
        calls = [
            ResponseToolCall(
                id=call.id,
                function=FunctionCall(
                    name=call.name, arguments="".join(call.arguments)
                ),
            )
            for call in self.calls
        ]
        return ResponseMessage(
            content=None if calls and not content else content,
            tool_calls=calls or None,
            reasoning_content="".join(self.reasoning) if self.thought else None,
        )


def finish_reason(engine: FinishReason, calls: bool) -> WireFinishReason:
    """The engine's reason on the wire: an answer that called tools and
    ended by itself ended with ``tool_calls``."""
    return "tool_calls" if calls and engine == "stop" else engine


def delta(part: Part) -> Delta:
    """The stream delta of one part."""
    if isinstance(part, Reasoning):
        return Delta(reasoning_content=part.text)
    if isinstance(part, str):
        return Delta(content=part)
    if isinstance(part, CallStart):
        call = DeltaToolCall(
            index=part.index,
            id=part.id,
            type="function",
            function=DeltaFunction(name=part.name, arguments=""),
        )
    else:
        call = DeltaToolCall(
            index=part.index, function=DeltaFunction(arguments=part.text)
        )
    return Delta(tool_calls=[call])
