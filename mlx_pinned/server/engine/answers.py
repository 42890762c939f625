"""A generation as the loop sees it, and its row's tokens turned into events.

The loop (:mod:`.loop`) hands each row's sampled tokens to its
:class:`RowAnswer` after every step, on the MLX thread: text per token
(:mod:`.text`, through :class:`~.quirks.SequenceText`), stop strings,
log-probabilities, and the final event with its counts and timings. A
:class:`Request` is made on the event loop; the loop writes it on the MLX
thread, and the event loop reads only whether it ended.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..events import (
    Event,
    FinalEvent,
    FinishReason,
    GenerationParams,
    PromptLogprob,
    TokenEvent,
    TokenLogprobs,
)
from .model import LoadedModel
from .quirks import SequenceText
from .rows import Row
from .sampling import Sampled
from .special_tokens import special_tokens
from .text import StopMatcher

if TYPE_CHECKING:
    from PIL import Image

    from .outputs import RowOutput

__all__ = ["Item", "Outputs", "Request", "RowAnswer"]

#: What a request reads: an event, or the error that ends its generation.
Item = Event | BaseException


class RowAnswer:
    """The events of one row, made as its tokens arrive.

    Args:
        loaded: The model (its tokenizer's text for each token).
        params: The request's parameters.
        row: The request's row of the batch.
        start: When the request was admitted (``time.perf_counter``).
    """

    def __init__(
        self, loaded: LoadedModel, params: GenerationParams, row: Row, start: float
    ) -> None:
        self.loaded = loaded
        self.row = row
        self._logprobs = params.sampling.logprobs
        self._max_tokens = params.max_tokens
        self._min_tokens = params.sampling.min_tokens
        self._include_stop = params.include_stop_str_in_output
        self._skipped = (
            frozenset(special_tokens(loaded).values())
            if params.skip_special_tokens
            else frozenset()
        )
        self._text = SequenceText(loaded)
        self._stops = StopMatcher(params.stop, include=self._include_stop)
        self._start = start
        self._first_token_at: float | None = None
        self._completion = 0

    def read(self) -> tuple[list[Item], bool]:
        """The events of the tokens sampled since the last read, and whether
        the answer ended (its last item is then a :class:`FinalEvent`, or
        the row's error once every token before it was handed out)."""
        row = self.row
        items: list[Item] = []
        while row.pending:
            if self._completion >= self._max_tokens:  # max_tokens 0: none
                row.pending.clear()
                items.append(self._final(self._stops.feed("")[0], "length"))
                return items, True
            item = row.pending.popleft()
            if item.eos:  # an end of turn or a stop token: not counted
                tail = self._add(item.token) if self._include_stop else ""
                tail, _ = self._stops.feed(tail + self._text.finish())
                items.append(self._final(tail, "stop"))
                return items, True
            text = self._add(item.token)
            self._completion += 1
            # vLLM looks for stop strings only past min_tokens.
            if self._completion > self._min_tokens:
                piece, stopped = self._stops.feed(text)
            else:
                piece, stopped = text, False
            if self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            logprobs = self._token_logprobs(item) if self._logprobs else None
            items.append(TokenEvent(piece, logprobs))
            if stopped:
                items.append(self._final("", "stop"))
                return items, True
        if row.error is not None:
            items.append(row.error)
            return items, True
        if row.done:  # max_tokens sampled, and all handed out
            tail, stopped = self._stops.feed(self._text.finish())
            items.append(self._final(tail, "stop" if stopped else "length"))
            return items, True
        return items, False

    def _add(self, token: int) -> str:
        """The text ``token`` completes; none for a special token left out
        (``skip_special_tokens``)."""
        return "" if token in self._skipped else self._text.add(token)

    def _final(self, tail: str, finish: FinishReason) -> FinalEvent:
        tail += self._stops.flush()  # held back as a possible stop string
        end = time.perf_counter()
        first = self._first_token_at or end
        return FinalEvent(
            text=tail,
            finish_reason=finish,
            prompt_tokens=self.row.prompt_tokens,
            completion_tokens=self._completion,
            prefill_seconds=first - self._start,
            decode_seconds=end - first,
            cached_tokens=self.row.cached,
            stop_sequence=self._stops.hit,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> tuple[PromptLogprob, ...]:
        scores = self.row.scores
        if scores is None:
            return ()
        token_text = self.loaded.token_text
        first, *rest = scores.tokens
        out = [PromptLogprob(first, *token_text(first), None, None, ())]
        for token, logprob, rank, top in zip(
            rest, scores.logprobs, scores.ranks, scores.top, strict=True
        ):
            text, raw = token_text(token)
            alternatives = tuple((i, token_text(i)[0], value) for i, value in top)
            out.append(PromptLogprob(token, text, raw, logprob, rank, alternatives))
        return tuple(out)

    def _token_logprobs(self, item: Sampled) -> TokenLogprobs:
        token_text = self.loaded.token_text
        text, raw = token_text(item.token)
        top = []
        for index, value in item.top:
            alt_text, alt_raw = token_text(index)
            top.append((alt_text, value, alt_raw))
        return TokenLogprobs(text, item.logprob, raw, top)


#: What one turn hands out: each request's new items, and whether the loop
#: holds no row of it any more.
Outputs = list[tuple["Request", tuple[Item, ...], bool]]


class Request:
    """One generation as the loop sees it.

    Its items reach it through ``output``, on the event loop (None for a
    caller that runs the loop's turns itself and reads their outputs).
    """

    __slots__ = (
        "answer",
        "ended",
        "held",
        "images",
        "output",
        "params",
        "row",
        "whole",
    )

    def __init__(
        self,
        params: GenerationParams,
        images: Sequence[Image.Image],
        output: RowOutput | None = None,
    ) -> None:
        self.params = params
        self.images = images
        self.output = output
        self.row: Row | None = None
        self.answer: RowAnswer | None = None
        self.ended = False  # the loop holds no row of it (set by the loop)
        # Its reader takes the answer whole: its items wait in ``held``
        # until it ended (MLX thread).
        self.whole = False
        self.held: list[Item] = []
