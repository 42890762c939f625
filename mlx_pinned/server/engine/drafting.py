"""Speculative decoding inside the batch: each row's drafts (prompt lookup, a
draft model, or its request's prediction) verified together in one forward
pass. MLX thread only; docs/engine.md says how and when it pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from ..config_checks import SettingError
from ..failures import RequestError
from .decode import Stepped
from .dflash_drafter import DFlashDrafter
from .draft_model import DraftModel
from .draft_policy import DraftPolicy, resting
from .logits import ban_words, bias_rows
from .native_drafter import NativeDrafter, native_kind
from .prompt_lookup import History, PromptLookup, follow
from .quirks import cache_kinds
from .rows import read
from .sampling import Sampled, collect, draw
from .verify_pass import Rollback, rollback_of, verify

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .decode import Decoder
    from .model import LoadedModel
    from .rows import Row
    from .state import BatchState

__all__ = ["DraftSettings", "DraftSource", "Drafting", "for_predictions", "install"]


@dataclass(frozen=True)
class DraftSettings:
    """How rows draft; one of ``ngram``, ``model`` or ``mtp``.

    Attributes:
        ngram: Longest n-gram of a row's tokens looked up (prompt lookup); 0:
            none.
        tokens: Draft tokens per row and step, at most (K).
        model: A draft model's or an mlx-vlm drafter's folder or hub id; None:
            none.
        max_batch: Speculate only while the batch holds at most this many
            rows (0: at any size); docs/engine.md says why.
        mtp: Draft with the MTP layers the served checkpoint carries."""

    ngram: int = 0
    tokens: int = 4
    model: str | Path | None = None
    max_batch: int = 0
    mtp: bool = False

    def __post_init__(self) -> None:
        if sum((bool(self.ngram), self.model is not None, self.mtp)) > 1:
            raise ValueError("draft by prompt lookup, a model or MTP: one of them")


class DraftSource(Protocol):
    """Where a batch's drafts come from. ``weight_bytes``: its parameters'."""

    weight_bytes: int

    def propose(self, rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
        """Up to ``counts[i]`` draft tokens for each row, for the step about to
        verify them."""
        ...

    def settle(self, rows: Sequence[Row], kept: Sequence[int]) -> None:
        """After that step: row ``i`` kept ``kept[i]`` of its drafts."""
        ...

    def reset(self) -> None:
        """The step failed: forget every row."""
        ...


def install(state: BatchState, settings: DraftSettings) -> None:
    """Make ``state``'s decoder speculate with ``settings`` (a draft model is
    loaded here).

    Raises:
        SettingError: The model's or the draft model's KV cache cannot be cut
            back, or the draft model's tokenizer is not the served model's.
    """
    loaded: LoadedModel = state.loaded
    setting = "prompt_lookup_tokens" if settings.model is None else "draft_model"
    setting = "mtp" if settings.mtp else setting
    lm = loaded.model.language_model
    rollback = rollback_of(lm)
    if rollback is None:
        flag = "--" + setting.replace("_", "-")
        raise SettingError(
            setting,
            "speculative decoding needs a KV cache that can be cut back; "
            f"this model's is {', '.join(cache_kinds(lm))}: serve it without {flag}",
        )
    source: DraftSource | None = None  # none: the requests' predictions
    if settings.mtp:
        source = NativeDrafter.load(loaded, state)
    elif settings.model is not None and native_kind(settings.model) is not None:
        source = NativeDrafter.load(loaded, state, settings.model)
    elif settings.model is not None:
        source = DraftModel.load(settings.model, loaded)
    elif settings.ngram:
        source = PromptLookup(settings.ngram)
    state.decoder.drafting = Drafting(settings, source, rollback)


# A predicted row's drafts: its n-grams matched in the prediction, and the
# tokens it drafts per step (an edit keeps long runs of its prediction);
# the most rows a batch drafting only predictions speculates with
# (docs/engine.md has the figures).
PREDICTION_NGRAM = 8
PREDICTION_TOKENS = 8
PREDICTION_MAX_BATCH = 4


def for_predictions(loaded: LoadedModel) -> Drafting:
    """The speculative step of a batch with no drafts of its own, for the
    predictions requests send.

    Raises:
        RequestError: The model's KV cache cannot be cut back.
    """
    rollback = rollback_of(loaded.model.language_model)
    if rollback is None:
        raise RequestError(
            "This model's KV cache cannot be cut back, so it takes no "
            "prediction: send the request without 'prediction'.",
            "prediction_unsupported",
            "prediction",
        )
    settings = DraftSettings(tokens=PREDICTION_TOKENS, max_batch=PREDICTION_MAX_BATCH)
    return Drafting(settings, None, rollback)


class Drafting:
    """The speculative step of one batch. ``source``: where the rows' drafts
    come from (None: only requests' predictions); ``rollback``: how the
    batch's cache takes back refused drafts."""

    def __init__(
        self,
        settings: DraftSettings,
        source: DraftSource | None,
        rollback: Rollback = Rollback.CUT,
    ) -> None:
        self.settings = settings
        self.source = source
        self.rollback = rollback
        costly = isinstance(source, (DraftModel, NativeDrafter, DFlashDrafter))
        self.policy = DraftPolicy(settings.tokens, settings.max_batch, costly)
        # The source drafts from the model's last hidden state (a native
        # drafter), or from its hidden states at some layers (DFlash,
        # EAGLE-3): every forward pass keeps them.
        self.wants_hidden: bool = getattr(source, "wants_hidden", False)
        self.capture: tuple[int, ...] = getattr(source, "capture", ())

    def hidden_kwargs(self) -> dict[str, Any]:
        """What a forward pass is asked for to keep the hidden states the
        source drafts from."""
        if self.capture:
            return {"capture_layer_ids": list(self.capture)}
        return {"return_hidden": True}

    def keep(
        self,
        decoder: Decoder,
        rows: list[Row],
        states: list[mx.array],
        kept: list[int] | None = None,
    ) -> None:
        """Hand a pass's hidden states (each (B, T, H), as the model gave
        them) to the source: row ``i`` kept its first ``kept[i] + 1``
        positions (None: its one)."""
        if isinstance(self.source, DFlashDrafter):
            self.source.observe(rows, mx.concatenate(states, axis=-1), kept)
            return
        hidden = states[-1]
        if kept is None:
            decoder.hidden = (rows, hidden[:, -1:])
        else:  # each row's at its last kept token
            last = mx.array(kept, dtype=mx.int32)[:, None, None]
            decoder.hidden = (rows, mx.take_along_axis(hidden, last, axis=1))

    def start(self, row: Row) -> None:
        """Give an admitted row its prompt's ids, the start of its history.

        Raises:
            RequestError: A prediction, where a draft model drafts.
        """
        if row.prediction is not None and isinstance(self.source, DraftModel):
            raise RequestError(
                "This model drafts with a draft model, which takes no "
                "prediction: send the request without 'prediction'.",
                "prediction_unsupported",
                "prediction",
            )
        assert row.prepared is not None
        ids = row.prepared.inputs.get("input_ids")
        if ids is not None:
            row.history = History(np.asarray(ids).reshape(-1))

    def applies(self, batch: BatchState) -> bool:
        """Whether the batch's next step may speculate: it has rows, no more than
        ``max_batch`` with those joining it, and each of them can draft."""
        policy = self.policy
        if not batch.rows or not policy.admits(len(batch.rows)):
            return False  # at once: a large batch pays nothing more per step
        joining = [row for rows, _ in batch.joining for row in rows]
        waiting = [*batch.waiting, *(row for row, _ in batch.prefilling)]
        live = [
            row
            for row in (*batch.rows, *joining, *waiting)
            if not (row.gone or row.done or row in batch.leaving)
        ]
        if not policy.admits(len(live)):
            return False
        if self.source is None and all(row.prediction is None for row in live):
            return False  # nothing would draft
        if all(resting(row) for row in batch.rows):
            return False  # pipelined until a row tries again
        return not any(row.needs.undraftable for row in live)

    def verify(self, batch: BatchState) -> Stepped | None:
        """One forward pass over every row's last token and its drafts; each
        row keeps its drafts up to the first the target's token differs
        from, and that token. None when no row has drafts."""
        rows = list(batch.rows)
        step = None
        try:
            each = self._propose(rows)
            if not any(each):
                self._settle(rows, [0] * len(rows))
                return None
            width = max(len(d) for d in each)
            inputs = [
                [row.token, *d, *[d[-1] if d else row.token] * (width - len(d))]
                for row, d in zip(rows, each, strict=True)
            ]
            kwargs: dict[str, Any] = {}
            if batch.deltas is not None:
                kwargs["rope_deltas"] = batch.deltas
            cache = batch.cache or []
            ids = mx.array(inputs, dtype=mx.uint32)
            step = verify(
                batch.lm,
                self.rollback,
                ids,
                cache,
                kwargs,
                hidden=self.wants_hidden,
                capture=self.capture,
            )
            logits = step.logits
            flat = logits.reshape(-1, logits.shape[-1])
            # Row i's position j is drawn as its token at sampled + j, after
            # its inputs up to j.
            at = [row for row in rows for _ in range(width + 1)]
            ahead = [j for _ in rows for j in range(width + 1)]
            if any(row.banned for row in rows):
                flat = ban_words(flat, _positions(rows, inputs))
            bias = bias_rows(rows, flat)
            if bias is not None:
                bias = mx.repeat(bias, width + 1, axis=0)
            states = [c.state for c in cache]
            sampled = collect(draw(flat, at, bias, states, ahead))
        except BaseException:
            if step is not None:
                step.abort()
            if self.source is not None:
                self.source.reset()
            raise
        items = [
            sampled[i * (width + 1) : (i + 1) * (width + 1)] for i in range(len(rows))
        ]
        kept = [
            _accepted(row_items, d) for row_items, d in zip(items, each, strict=True)
        ]
        read_rows, got = read(
            rows, [row_items[: k + 1] for row_items, k in zip(items, kept, strict=True)]
        )
        step.commit(kept)
        if step.hidden is not None:
            self.keep(batch.decoder, rows, [step.hidden], kept)
        self._settle(rows, kept)
        for row, d, k in zip(rows, each, kept, strict=True):
            self.policy.pace(row, len(d), k)
            if row.prediction is not None:
                tried, used = row.predicted
                row.predicted = (tried + len(d), used + k)
        drafted = sum(len(d) for d in each)
        return Stepped(read_rows, got, len(rows), drafted, sum(kept), speculative=True)

    def _propose(self, rows: list[Row]) -> list[list[int]]:
        left = [0 if resting(row) else row.max_tokens - row.sampled - 1 for row in rows]
        policy = self.policy
        each = (
            self.source.propose(
                rows, [policy.count(row, n) for row, n in zip(rows, left, strict=True)]
            )
            if self.source is not None
            else [[] for _ in rows]
        )
        for i, row in enumerate(rows):
            if row.prediction is not None and row.history is not None:
                count = min(PREDICTION_TOKENS, left[i])
                answer = row.history.answer
                each[i] = follow(row.prediction, answer, PREDICTION_NGRAM, count)
        return each

    def _settle(self, rows: list[Row], kept: list[int]) -> None:
        if self.source is not None:
            self.source.settle(rows, kept)


@dataclass
class _Position:
    """A row at one position of a speculative step, as :func:`.logits.ban_words`
    reads it."""

    banned: tuple[tuple[int, ...], ...]
    recent: list[int]
    done: bool


def _positions(rows: Sequence[Row], inputs: list[list[int]]) -> list[_Position]:
    """Each row at each position of a step over ``inputs``: its tokens so far
    are its own and the drafts before."""
    return [
        _Position(row.banned, [*row.recent, *row_inputs[1 : j + 1]], row.done)
        for row, row_inputs in zip(rows, inputs, strict=True)
        for j in range(len(row_inputs))
    ]


def _accepted(items: Sequence[Sampled], drafts: Sequence[int]) -> int:
    """Drafts kept: up to the first the target's token differs from, or that
    ends the turn."""
    kept = 0
    while kept < len(drafts) and items[kept].token == drafts[kept]:
        if items[kept].eos:
            break
        kept += 1
    return kept
