"""The answer as chat completions writes it: a message, deltas, chunks.

Event loop (pure CPU). A stream's deltas join to exactly the whole answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...events import FinalEvent, FinishReason, TokenEvent, TokenLogprobs
from ...formats import CallStart
from ..answer_parser import Part, Reasoning
from .bodies import (
    ChoiceLogprobs,
    ChunkChoice,
    ChunkEncoder,
    CompletionTokensDetails,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ResponseMessage,
    ResponseToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
    WireFinishReason,
)

__all__ = [
    "Answer",
    "content_choice",
    "delta",
    "finish_reason",
    "parsed_chunks",
    "token_logprob",
    "usage",
]


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


@dataclass
class Answer:
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


def usage(event: FinalEvent, *, predicted: bool = False) -> Usage:
    """The usage of an answer; ``predicted``: its request sent a
    ``prediction`` (its tokens kept and not kept are counted)."""
    details = None
    if predicted:
        details = CompletionTokensDetails(
            accepted_prediction_tokens=event.accepted_prediction_tokens,
            rejected_prediction_tokens=event.rejected_prediction_tokens,
        )
    return Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=event.cached_tokens),
        completion_tokens_details=details,
    )


def token_logprob(lp: TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(
        token=lp.token,
        logprob=lp.logprob,
        bytes=lp.bytes,
        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=b) for t, v, b in lp.top],
    )


def parsed_chunks(
    chunks: ChunkEncoder, parts: list[Part], event: TokenEvent | None = None
) -> bytes:
    """A chunk per part of the answer; a token's logprobs go with its first
    chunk (a token that released nothing yet still gets one, empty)."""
    logprobs = None
    if event is not None and event.logprobs is not None:
        logprobs = ChoiceLogprobs(content=[token_logprob(event.logprobs)])
        if not parts:
            parts = [""]
    out = []
    for part in parts:
        if isinstance(part, str) and logprobs is None:
            out.append(chunks.content(part))  # the common chunk, from its template
        else:
            choice = ChunkChoice(delta=delta(part), logprobs=logprobs)
            out.append(chunks.chunk([choice]))
        logprobs = None
    return b"".join(out)


def content_choice(event: TokenEvent) -> ChunkChoice:
    logprobs = None
    if event.logprobs is not None:
        logprobs = ChoiceLogprobs(content=[token_logprob(event.logprobs)])
    return ChunkChoice(delta=Delta(content=event.text), logprobs=logprobs)
