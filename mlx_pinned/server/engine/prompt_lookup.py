"""Prompt lookup: drafts from a row's own tokens, no model (:func:`lookup`),
or from its request's predicted answer (:func:`follow`). MLX thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .rows import Row

__all__ = ["History", "PromptLookup", "follow", "lookup"]


class History:
    """A row's prompt and answer token ids, growable."""

    def __init__(self, prompt: np.ndarray) -> None:
        self._ids = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)
        self._ids[: len(prompt)] = prompt
        self.size = self.prompt_size = len(prompt)

    def append(self, token: int) -> None:
        if self.size == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
        self._ids[self.size] = token
        self.size += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.size]

    @property
    def answer(self) -> np.ndarray:
        return self._ids[self.prompt_size : self.size]


def lookup(ids: np.ndarray, ngram: int, count: int) -> list[int]:
    """Up to ``count`` tokens after the latest earlier occurrence of ``ids``'s
    last n tokens (n from ``ngram`` down), continued as a repeat of that
    period where it runs into the end; empty when no n-gram recurs."""
    size = len(ids)
    if count < 1:
        return []
    for n in range(min(ngram, size - 1), 0, -1):
        tail = ids[size - n :]
        # Windows starting at 0 .. size-n-1: each has a token after it.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if not len(hits):
            continue
        start = int(hits[-1]) + n  # the token that followed it
        period = size - start
        return [int(ids[start + (j % period)]) for j in range(count)]
    return []


def follow(
    prediction: np.ndarray, answer: np.ndarray, ngram: int, count: int
) -> list[int]:
    """Up to ``count`` tokens of ``prediction`` after the match of ``answer``'s
    last n tokens (n from ``ngram`` down) that ends nearest the answer's own
    length, as an edit keeps its text in place; its first tokens for an empty
    answer; empty when none matches."""
    if count < 1:
        return []
    size = len(answer)
    if size == 0:
        return [int(t) for t in prediction[:count]]
    for n in range(min(ngram, size, len(prediction)), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(prediction, n)
        hits = np.flatnonzero((windows == answer[size - n :]).all(axis=1)) + n
        if len(hits):
            end = int(hits[np.argmin(np.abs(hits - size))])
            return [int(t) for t in prediction[end : end + count]]
    return []


class PromptLookup:
    """Drafts by prompt lookup: no model, nothing kept."""

    weight_bytes = 0

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram

    def propose(self, rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
        return [
            [] if row.history is None else lookup(row.history.ids, self.ngram, count)
            for row, count in zip(rows, counts, strict=True)
        ]

    def settle(self, rows: Sequence[Row], kept: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        pass
