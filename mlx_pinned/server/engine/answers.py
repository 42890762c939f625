"""A generation as the loop sees it (:class:`Request`), and its row's tokens
turned into events (:class:`RowAnswer`: text, stop strings,
log-probabilities, the final event). MLX thread, but a :class:`Request`
is made on the event loop, which then reads only whether it ended.
"""

from __future__ import annotations

import codecs
import importlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..events import (
    Event,
    FinalEvent,
    FinishReason,
    GenerationParams,
    PromptLogprob,
    PromptProgress,
    TokenEvent,
    TokenLogprobs,
)
from .model import LoadedModel
from .rows import Row
from .sampling import Sampled
from .special_tokens import special_tokens

if TYPE_CHECKING:
    from PIL import Image

    from .driver import RowOutput

__all__ = [
    "Item",
    "Outputs",
    "Request",
    "RowAnswer",
    "SequenceText",
    "StopMatcher",
    "TextDecoder",
]

#: What a request reads: an event, its prompt's progress (apart from the
#: events), or the error that ends its generation.
Item = Event | PromptProgress | BaseException


class RowAnswer:
    """The events of one row, made as its tokens arrive. ``start``: when its
    request was admitted (``time.perf_counter``)."""

    def __init__(
        self, loaded: LoadedModel, params: GenerationParams, row: Row, start: float
    ) -> None:
        self.loaded = loaded
        self.row = row
        self._logprobs = params.sampling.logprobs
        # The request's, or what the context left (the row's; 1 for 0 asked).
        self._max_tokens = min(params.max_tokens, row.max_tokens)
        self._as_ids = params.return_tokens_as_token_ids
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
        self._reported: tuple[int, int] | None = None  # (cached, processed)

    def progress(self) -> PromptProgress | None:
        """Its prompt's progress where it moved since the last call (the
        first call: where it starts); None once its first token was
        reported as the prompt's end."""
        row, last = self.row, self._reported
        total = row.prompt_tokens
        if last is not None and last[1] == total:
            return None
        began = bool(row.pending) or row.done
        now = (row.cached, total if began else max(row.cached, row.prefilled))
        if now == last:
            return None
        self._reported = now
        seconds = time.perf_counter() - self._start
        return PromptProgress(total, now[0], now[1], seconds)

    def read(self) -> tuple[list[Item], bool]:
        """The events of the tokens sampled since the last read, and whether the
        answer ended (its last item then its final event, or its error)."""
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
                stop_token = row.sampling.stop_token(item.token)
                items.append(self._final(tail, "stop", stop_token))
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
        return "" if token in self._skipped else self._text.add(token)

    def _final(
        self, tail: str, finish: FinishReason, stop_token: int | None = None
    ) -> FinalEvent:
        """``stop_token``: the one that ended it (a stop string that did is its
        ``stop_reason`` first)."""
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
            stop_reason=stop_token if self._stops.hit is None else self._stops.hit,
            prompt_logprobs=self._prompt_logprobs(),
            accepted_prediction_tokens=self.row.predicted[1],
            rejected_prediction_tokens=self.row.predicted[0] - self.row.predicted[1],
        )

    def _token_text(self, token: int) -> tuple[str, list[int]]:
        """Its text, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""
        text, raw = self.loaded.token_text(token)
        return (f"token_id:{token}", raw) if self._as_ids else (text, raw)

    def _prompt_logprobs(self) -> tuple[PromptLogprob, ...]:
        scores = self.row.scores
        if scores is None:
            return ()
        token_text = self._token_text
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
        token_text = self._token_text
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
    """One generation as the loop sees it; its items reach its ``output``
    (None for a caller that runs the loop's turns itself)."""

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


class StopMatcher:
    """Cuts generated text at the first stop string; text that could start one
    is held back until it is known not to, so a stop string never reaches
    the client (with ``include``, the text ends with it)."""

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = tuple(stops)
        self._include = include
        self._pending = ""
        self.hit: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """The text safe to release, and whether a stop string hit."""
        if not self.stops:
            return text, False
        pending = self._pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            first = min(hits)
            self.hit = next(s for s in self.stops if pending.find(s) == first)
            end = first + len(self.hit) if self._include else first
            return pending[:end], True
        hold = 0
        for k in range(min(len(pending), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self.stops):
                hold = k
                break
        self._pending = pending[len(pending) - hold :]
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


class TextDecoder:
    """Text per token: byte-level BPE tokens through an incremental UTF-8
    decoder, so text streams token by token instead of word by word; other
    tokenizers through mlx-vlm's own streaming detokenizer."""

    def __init__(self, processor: Any, token_bytes: Callable[[int], list[int]]) -> None:
        detokenizer = getattr(processor, "detokenizer", None)
        self._token_bytes = token_bytes
        self._bytes = getattr(detokenizer, "_byte_decoder", None) is not None
        self._trim = bool(getattr(detokenizer, "trim_space", False))
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False

    def add(self, token: int, fallback: str) -> str:
        """``fallback``: mlx-vlm's text for it."""
        if not self._bytes:
            return fallback
        return self._emit(self._decoder.decode(bytes(self._token_bytes(token))))

    def finish(self, fallback: str) -> str:
        if not self._bytes:
            return fallback
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._trim and not self._started and text.startswith(" "):
            text = text[1:]
        self._started = self._started or bool(text)
        return text


class SequenceText:
    """A sequence's text, token by token, as ``mlx_vlm.stream_generate``
    makes it: a processor's streaming detokenizer is shared by every
    request of the model, so each sequence gets its own."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._decoder = TextDecoder(loaded.processor, lambda t: loaded.token_text(t)[1])
        self._detokenizer: Any = None
        detokenizer = getattr(loaded.processor, "detokenizer", None)
        if (
            detokenizer is not None
            and getattr(detokenizer, "_byte_decoder", None) is None
        ):
            # Not byte-level: the decoder uses mlx-vlm's text, from a
            # detokenizer of this sequence's own.
            utils = importlib.import_module("mlx_vlm.tokenizer_utils")
            self._detokenizer = utils.make_streaming_detokenizer(loaded.processor)

    def add(self, token: int) -> str:
        fallback = ""
        if self._detokenizer is not None:
            self._detokenizer.add_token(token)
            fallback = str(self._detokenizer.last_segment)
        return self._decoder.add(token, fallback)

    def finish(self) -> str:
        fallback = ""
        if self._detokenizer is not None:
            self._detokenizer.finalize()
            fallback = str(self._detokenizer.last_segment)
        return self._decoder.finish(fallback)
