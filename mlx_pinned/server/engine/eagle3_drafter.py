"""EAGLE-3 drafting in the batch: an mlx-vlm EAGLE-3 drafter drafting for
each row from the served model's hidden states at the drafter's capture
layers and the tokens that followed them. MLX thread only.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from .dflash_drafter import DFlashDrafter, _greedy

if TYPE_CHECKING:
    from .rows import Row

__all__ = ["Eagle3Drafter"]


class Eagle3Drafter(DFlashDrafter):
    """Drafts with an mlx-vlm drafter of the ``eagle3`` kind; a
    :class:`~.drafting.DraftSource`.

    mlx-vlm's EAGLE-3 drafter keeps its round's state on itself (its cache,
    its next seed token, its position), for one stream or one fixed batch.
    Here each row has its own shallow copy of it, sharing its weights, and
    drives it as mlx-vlm's single-stream round loop (``_eagle3_rounds``)
    does: ``accept_verified_tokens`` feeds it the hidden states kept since
    the row last drafted, each with the token that followed it (which also
    takes back its own drafts of the round before), then ``draft_block``
    drafts from its seed. A row's context starts at its first decode step,
    as a DFlash drafter's does.
    """

    kind = "eagle3"

    @staticmethod
    def layers_of(drafter: Any) -> list[int]:
        config = drafter.config
        return [int(i) for i in getattr(config, "capture_layer_ids", None) or []]

    def takes(self, row: Row) -> bool:
        return row.history is not None  # the tokens after its hidden states

    def fresh(self) -> Any:
        own = copy.copy(self.drafter)
        own.reset(self.model)
        return own

    def draft(self, row: Row, hidden: mx.array, state: Any, size: int) -> mx.array:
        count = int(hidden.shape[1])
        assert row.history is not None
        # The tokens that followed each kept hidden state: the row's last.
        ids = row.history.ids[-count:].tolist()
        before = mx.array([ids[:-1]], dtype=mx.int32)
        state.accept_verified_tokens(
            hidden, before, count - 1, ids[-1:], _greedy, greedy=True
        )
        drafts = state.draft_block(row.token, hidden, None, size, _greedy, greedy=True)
        return cast("mx.array", drafts)
