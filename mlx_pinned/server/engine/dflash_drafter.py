"""DFlash drafting in the batch: an mlx-vlm DFlash drafter (``qwen3_dflash``
and the others of the ``dflash`` kind) drafting a block for each row from
the served model's hidden states at the drafter's target layers, which
every forward pass of the batch keeps while it is installed. MLX thread
only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ..config_checks import SettingError

if TYPE_CHECKING:
    from .model import LoadedModel
    from .rows import Row

__all__ = ["DFlashDrafter"]

# Families whose language model keeps the outputs of chosen layers
# (``capture_layer_ids``) in a plain pass and in its own verifier.
_CAPTURING = frozenset({"qwen3_5", "qwen3_5_moe"})


@dataclass(eq=False)
class _Context:
    """A row's drafter state (DFlash: its drafter cache, the projected
    hidden states of the tokens it has drafted after) and the hidden states
    kept since (1, n, layers * H)."""

    state: Any
    pending: list[mx.array] = field(default_factory=list)


class DFlashDrafter:
    """Drafts with an mlx-vlm drafter of the ``dflash`` kind; a
    :class:`~.drafting.DraftSource`.

    As mlx-vlm's batch round loop (``_dflash_rounds_batch``) does, each row
    drafts alone, into its own drafter cache, and that cache grows only by
    the hidden states of the tokens the row kept: the verify pass hands
    them over (:meth:`observe`) after it is cut back, so nothing in the
    drafter's cache is ever rolled back. A row's context starts at its first
    decode step: a prefill (or the prompt cache) keeps no hidden states.
    """

    wants_hidden = True
    kind = "dflash"

    def __init__(self, drafter: Any, loaded: LoadedModel) -> None:
        from mlx.utils import tree_flatten

        self.drafter = drafter
        self.model = loaded.model
        self.capture = tuple(self.layers_of(drafter))
        self.vocab_size = loaded.vocab_size
        self.contexts: dict[Row, _Context] = {}
        flat = cast("list[tuple[str, mx.array]]", tree_flatten(drafter.parameters()))
        self.weight_bytes = sum(int(v.nbytes) for _, v in flat)
        drafter.bind(loaded.model)

    @classmethod
    def checked(cls, drafter: Any, loaded: LoadedModel, path: object) -> DFlashDrafter:
        """``drafter`` for ``loaded``, once its target layers are the model's.

        Raises:
            SettingError: The model keeps no hidden states of its layers, or
                has fewer layers than the drafter reads.
        """
        lm = loaded.model.language_model
        parts = type(lm).__module__.split(".")
        family = parts[2] if len(parts) > 2 and parts[1] == "models" else ""
        if family not in _CAPTURING:
            raise SettingError(
                "draft_model",
                f"draft_model: {path} is a {cls.kind} drafter, which drafts "
                f"here only for the families {', '.join(sorted(_CAPTURING))}",
            )
        layers = len(lm.model.layers)
        wanted = cls.layers_of(drafter)
        if not wanted or not all(0 <= i < layers for i in wanted):
            raise SettingError(
                "draft_model",
                f"draft_model: {path} reads layers {wanted} of a model of "
                f"{layers}: give the drafter made for this model",
            )
        return cls(drafter, loaded)

    @staticmethod
    def layers_of(drafter: Any) -> list[int]:
        """The served model's layers whose outputs ``drafter`` reads."""
        return [int(i) for i in drafter.config.target_layer_ids]

    def observe(
        self, rows: Sequence[Row], hidden: mx.array, kept: Sequence[int] | None
    ) -> None:
        """A forward pass over ``rows`` kept ``hidden`` (B, T, layers * H);
        row ``i`` keeps its first ``kept[i] + 1`` positions (None: its one)."""
        self._forget_all_but(rows)
        for i, row in enumerate(rows):
            context = self.contexts.get(row)
            if context is None and not self.takes(row):
                continue
            if context is None:
                context = self.contexts[row] = _Context(self.fresh())
            end = 1 if kept is None else kept[i] + 1
            context.pending.append(hidden[i : i + 1, :end])

    def propose(self, rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
        self._forget_all_but(rows)
        most = max(counts, default=0)
        ready = [
            i
            for i, (row, count) in enumerate(zip(rows, counts, strict=True))
            if count > 0 and row in self.contexts and self.contexts[row].pending
        ]
        each: list[list[int]] = [[] for _ in rows]
        if most < 1 or not ready:
            return each
        blocks = []
        for i in ready:
            context = self.contexts[rows[i]]
            pending, context.pending = context.pending, []
            hidden = pending[0] if len(pending) == 1 else mx.concatenate(pending, 1)
            blocks.append(self.draft(rows[i], hidden, context.state, most + 1))
        found = cast(
            "list[list[int]]", mx.concatenate(blocks).astype(mx.int32).tolist()
        )
        for i, drafts in zip(ready, found, strict=True):
            each[i] = self._valid(drafts[: counts[i]])
        return each

    def takes(self, row: Row) -> bool:
        """Whether ``row`` can draft."""
        return True

    def fresh(self) -> Any:
        """A new row's drafter state."""
        return self.drafter.make_cache()

    def draft(self, row: Row, hidden: mx.array, state: Any, size: int) -> mx.array:
        """``size - 1`` drafts (1, size - 1) after ``row``'s last token, its
        state first fed ``hidden``: the hidden states kept since it last
        drafted."""
        drafter = self.drafter
        draft = getattr(drafter, "draft_block_greedy", drafter.draft_block)
        return cast("mx.array", draft(row.token, hidden, state, size, _greedy))

    def settle(self, rows: Sequence[Row], kept: Sequence[int]) -> None:
        """Nothing to cut back: the kept tokens' hidden states come through
        :meth:`observe`."""

    def reset(self) -> None:
        """The step failed: every row starts its context again."""
        self.contexts.clear()

    def _forget_all_but(self, rows: Sequence[Row]) -> None:
        """Rows that left the batch: their contexts go."""
        live = set(rows)
        for row in [row for row in self.contexts if row not in live]:
            del self.contexts[row]

    def _valid(self, drafts: list[int]) -> list[int]:
        for i, token in enumerate(drafts):
            if token >= self.vocab_size:
                return drafts[:i]
        return drafts


def _greedy(logits: mx.array) -> mx.array:
    """The drafter's sampler where it has no argmax of its own: greedy
    drafts, which the verify pass keeps or refuses exactly."""
    return mx.argmax(logits, axis=-1)
