"""The answer as legacy completions writes it: choices, logprobs, chunks.
Event loop (pure CPU). A stream's texts join to exactly the whole answer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...events import FinalEvent, FinishReason, TokenEvent
from ..vllm_extensions import StopReason, StopReasonChoice, VLLMPromptLogprobs
from ..wire import random_hex, sse_event

__all__ = [
    "ChoiceText",
    "ChunkWriter",
    "Completion",
    "CompletionChoice",
    "Logprobs",
    "Usage",
    "completion_id",
    "usage",
]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Logprobs(_Response):
    """With ``echo``, the prompt's tokens come first (the first one's null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response, StopReasonChoice):
    text: str
    index: int
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None  # vLLM's, only with finish_reason
    # vLLM's, only when asked for (left out otherwise).
    prompt_logprobs: VLLMPromptLogprobs | None = Field(
        default=None, exclude_if=lambda logprobs: logprobs is None
    )

    @classmethod
    def ending(
        cls,
        index: int,
        text: str,
        final: FinalEvent | None,
        logprobs: Logprobs | None = None,
        prompt_logprobs: VLLMPromptLogprobs | None = None,
    ) -> CompletionChoice:
        """A choice that ended as ``final`` says (None: not yet, a chunk's)."""
        return cls(
            text=text,
            index=index,
            logprobs=logprobs,
            finish_reason=None if final is None else final.finish_reason,
            stop_reason=None if final is None else final.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(_Response):
    """A whole answer, or a chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: None = None
    usage: Usage | None = None


def usage(finals: list[FinalEvent]) -> Usage:
    prompt = sum(final.prompt_tokens for final in finals)
    completion = sum(final.completion_tokens for final in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
    )


@dataclass
class ChoiceText:
    """One choice's text and log-probabilities as its events arrive.

    Each token's ``text_offset`` counts the token texts before it, as vLLM's
    does, from ``offset``. ``echo_top``: the prompt's tokens come first in
    the whole lists, with this many alternatives each (None: left out).
    """

    logprobs: bool
    echo_top: int | None = None
    offset: int = 0
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    final: FinalEvent | None = None

    def add(self, event: TokenEvent | FinalEvent) -> tuple[str, Logprobs | None]:
        """Record ``event``; its text and its token's log-probabilities
        (None when not asked for, and for the final event), for a chunk."""
        self.text.append(event.text)
        if isinstance(event, FinalEvent):
            self.final = event
            return event.text, None
        if not self.logprobs or event.logprobs is None:
            return event.text, None
        start = len(self.tokens)
        lp = event.logprobs
        self.text_offset.append(self.offset)
        self.offset += len(lp.token)
        self.tokens.append(lp.token)
        self.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for token, logprob, _ in lp.top:
            top.setdefault(token, logprob)  # two ids of one text: the likelier
        self.top_logprobs.append(top)
        return event.text, self._since(start)

    def whole(self) -> Logprobs | None:
        """Every token's log-probabilities, the echoed prompt's first."""
        generated = self._since(0)
        entries = self.final.prompt_logprobs if self.final is not None else ()
        if generated is None or self.echo_top is None or not entries:
            return generated
        tokens = [entry.token for entry in entries]
        starts = [0]
        for token in tokens:
            starts.append(starts[-1] + len(token))
        shift = starts.pop()
        tops: list[dict[str, float] | None] = [None]
        for entry in entries[1:]:
            top: dict[str, float] = {}
            for _, text, logprob in entry.top[: self.echo_top]:
                top.setdefault(text, logprob)
            tops.append(top)
        return Logprobs(
            tokens=tokens + generated.tokens,
            token_logprobs=[e.logprob for e in entries] + generated.token_logprobs,
            top_logprobs=tops + generated.top_logprobs,
            text_offset=starts + [shift + o for o in generated.text_offset],
        )

    def _since(self, start: int) -> Logprobs | None:
        if not self.logprobs:
            return None
        return Logprobs(
            tokens=self.tokens[start:],
            token_logprobs=self.token_logprobs[start:],
            top_logprobs=self.top_logprobs[start:],
            text_offset=self.text_offset[start:],
        )


class ChunkWriter:
    def __init__(self, id: str, created: int, model: str, *, include_usage: bool):
        self.id, self.created, self.model = id, created, model
        self.include_usage = include_usage

    def chunk(
        self,
        index: int,
        text: str,
        logprobs: Logprobs | None = None,
        final: FinalEvent | None = None,
    ) -> bytes:
        choice = CompletionChoice.ending(index, text, final, logprobs)
        return self._sse(self._completion([choice]).model_dump())

    def usage(self, value: Usage) -> bytes:
        return self._sse(self._completion([], value).model_dump())

    def _completion(
        self, choices: list[CompletionChoice], value: Usage | None = None
    ) -> Completion:
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=value,
        )

    def _sse(self, data: dict[str, Any]) -> bytes:
        if not self.include_usage:
            del data["usage"]  # OpenAI sends "usage": null only when asked
        return sse_event(data)


def completion_id() -> tuple[str, int]:
    return f"cmpl-{random_hex(96)}", int(time.time())
