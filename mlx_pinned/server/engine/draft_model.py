"""A draft model: a small model of the served model's tokenizer that drafts
the batch's next tokens greedily, from a batch KV cache of its own that
follows the batch's rows (docs/engine.md, "A draft model"). It changes no
answer: the served model verifies every draft. MLX thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from ..config_checks import SettingError
from .model import LoadedModel, load
from .prefill import PREFILL_STEP, batch_caches
from .quirks import cut_back, uncuttable_kinds, unmask_if_unpadded

if TYPE_CHECKING:
    from .rows import Row

__all__ = ["DraftModel"]


class DraftModel:
    """Drafts from a small model, batched; a :class:`~.drafting.DraftSource`.
    ``rows``: the rows in its cache, in its cache's order."""

    def __init__(self, loaded: LoadedModel, vocab_size: int) -> None:
        self.loaded = loaded
        # Ids past the served model's output (padding rows of a larger
        # draft's embedding) are never drafted.
        self.vocab_size = vocab_size
        self.weight_bytes = loaded.weight_bytes
        self.lm: Any = loaded.model.language_model
        self.rows: list[Row] = []
        self.cache: list[Any] | None = None
        # History tokens each row's cache holds; its unfed tokens follow:
        # one as a rule, two after a step that kept all its drafts (the
        # last draft was never fed), as mlx-lm's speculative_generate_step.
        self._held: dict[Row, int] = {}
        self._passes = 0  # the draft passes of the step being verified

    @classmethod
    def load(cls, path: str | Path, target: LoadedModel) -> DraftModel:
        """Load a draft model for ``target``.

        Raises:
            SettingError: Its tokenizer is not ``target``'s, or its KV cache
                cannot be cut back.
        """
        loaded = load(path)
        theirs = target.tokenizer.get_vocab()
        if loaded.tokenizer.get_vocab() != theirs:
            raise SettingError(
                "draft_model",
                f"draft_model (--draft-model): {path} has another tokenizer "
                f"than the served model {target.path}; a draft model must "
                "share its tokenizer (the same tokens, the same ids)",
            )
        kinds = uncuttable_kinds(loaded.model.language_model)
        if kinds:
            raise SettingError(
                "draft_model",
                f"draft_model (--draft-model): {path} keeps {', '.join(kinds)} "
                "layers, which cannot be cut back: pick a draft model with "
                "plain attention layers",
            )
        return cls(loaded, target.vocab_size)

    def propose(self, rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
        most = max(counts, default=0)
        if most < 1:
            return [[] for _ in rows]
        try:
            self._follow(rows)
            drafts = self._draft(most) if self.rows else []
        except BaseException:
            self.reset()
            raise
        mine = dict(zip(self.rows, drafts, strict=True))
        return [
            self._valid(mine.get(row, [])[:count])
            for row, count in zip(rows, counts, strict=True)
        ]

    def settle(self, rows: Sequence[Row], kept: Sequence[int]) -> None:
        """Cut each row's cache back to the drafts the served model kept (of the
        ``passes - 1`` fed)."""
        fed, self._passes = self._passes - 1, 0
        if fed < 0 or not self.rows:
            return
        kept_by = dict(zip(rows, kept, strict=True))
        keep = [min(kept_by.get(row, 0), fed) for row in self.rows]
        cut_back(self.cache or [], fed, keep)
        for row, count in zip(self.rows, keep, strict=True):
            self._held[row] += count

    def _valid(self, drafts: list[int]) -> list[int]:
        for i, token in enumerate(drafts):
            if token >= self.vocab_size:
                return drafts[:i]
        return drafts

    def reset(self) -> None:
        self.rows, self.cache, self._held, self._passes = [], None, {}, 0

    def _unfed(self, row: Row) -> int:
        assert row.history is not None
        return row.history.size - self._held[row]

    def _follow(self, rows: Sequence[Row]) -> None:
        """Drop the rows that left the batch or whose cache fell behind; prefill
        the rows new to it."""
        present = set(rows)
        keep = [
            i
            for i, row in enumerate(self.rows)
            if row in present and 1 <= self._unfed(row) <= 2
        ]
        dropped = len(keep) < len(self.rows)
        if dropped:
            self.rows = [self.rows[i] for i in keep]
            self._held = {row: self._held[row] for row in self.rows}
            if not keep:
                self.cache = None
            else:
                index = mx.array(keep, dtype=mx.int32)
                for c in self.cache or ():
                    c.filter(index)
        new = [
            row
            for row in rows
            if row not in self._held
            and row.history is not None
            and row.history.size > 1
        ]
        # A long history is prefilled alone: the others are not padded to it.
        short = [row for row in new if _size(row) <= PREFILL_STEP]
        if short:
            self._prefill(short)
        for row in new:
            if row not in short:
                self._prefill([row])
        if dropped or new:  # the rows' padding changed (cut_back sees to its own)
            unmask_if_unpadded(self.cache)

    def _prefill(self, rows: list[Row]) -> None:
        """Each row's history but its last token, left-padded into one batch cache
        (a prefill step at a time), joined to the draft's."""
        histories = [row.history.ids[:-1] for row in rows if row.history is not None]
        width = max(len(ids) for ids in histories)
        pads = [width - len(ids) for ids in histories]
        ids = mx.array(
            np.stack(
                [np.pad(h, (pad, 0)) for h, pad in zip(histories, pads, strict=True)]
            ),
            dtype=mx.uint32,
        )
        cache = batch_caches(self.lm, pads)
        assert cache is not None, "load() takes plain KV caches only"
        kwargs = self._kwargs(len(rows))
        for start in range(0, width, PREFILL_STEP):
            self.lm(ids[:, start : start + PREFILL_STEP], cache=cache, **kwargs)
            mx.eval([c.state for c in cache])
        if self.cache is None:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(theirs)
        self.rows.extend(rows)
        for row, history in zip(rows, histories, strict=True):
            self._held[row] = len(history)

    def _draft(self, passes: int) -> list[list[int]]:
        """``passes`` greedy tokens for each row: the first pass feeds the rows'
        unfed tokens, each next one the token before."""
        rows, cache = self.rows, self.cache or []
        kwargs = self._kwargs(len(rows))
        unfed = []
        for row in rows:
            assert row.history is not None
            unfed.append(row.history.ids[self._held[row] :].tolist())
        width = max(len(p) for p in unfed)
        # A row with fewer unfed tokens has its last one written again
        # after them: rolled away below.
        inputs = [[*p, *[p[-1]] * (width - len(p))] for p in unfed]
        logits = self.lm(
            mx.array(inputs, dtype=mx.uint32), cache=cache, **kwargs
        ).logits
        if width > 1:
            last = mx.array([len(p) - 1 for p in unfed], dtype=mx.int32)
            logits = mx.take_along_axis(logits, last[:, None, None], axis=1)
            cut_back(cache, width - 1, [len(p) - 1 for p in unfed])
        for row, p in zip(rows, unfed, strict=True):
            self._held[row] += len(p)
        token = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.uint32)
        tokens = [token]
        for _ in range(passes - 1):
            logits = self.lm(token[:, None], cache=cache, **kwargs).logits
            token = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.uint32)
            tokens.append(token)
        drafts = mx.stack(tokens, axis=1)
        mx.eval(drafts, [c.state for c in cache])
        self._passes = passes
        return cast("list[list[int]]", drafts.tolist())

    def _kwargs(self, rows: int) -> dict[str, Any]:
        """A Qwen-VL model's rope deltas, given (zero: text only), so it reads none
        it kept from another call."""
        if hasattr(self.lm, "_rope_deltas"):
            return {"rope_deltas": mx.zeros((rows, 1), dtype=mx.int32)}
        return {}


def _size(row: Row) -> int:
    assert row.history is not None
    return row.history.size
