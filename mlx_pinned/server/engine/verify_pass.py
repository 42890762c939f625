"""A speculative step's forward pass over each row's last token and its
drafts, and taking back what the rows did not keep: the KV positions of
refused drafts, a sliding window's overwritten slots and a recurrent
layer's state (through mlx-vlm's cache transactions). MLX thread only.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .quirks import cut_back, unmask_if_unpadded

__all__ = ["Rollback", "VerifyPass", "rollback_of", "verify"]


class Rollback(enum.Enum):
    """How a model's batch cache gives back a step's refused drafts.

    Attributes:
        CUT: Every layer is plain KV: cut back and rolled into the left
            padding (:func:`.quirks.cut_back`).
        WINDOWED: Plain KV and sliding windows: mlx-vlm's cache transaction
            replays the kept tokens into each window.
        RECURRENT: Recurrent layers (Qwen3.5's gated delta-net): the model's
            own exact verifier keeps the state after every drafted token, and
            its transaction keeps each row's.
    """

    CUT = "cut"
    WINDOWED = "windowed"
    RECURRENT = "recurrent"


# Families whose language model verifies drafts itself (mlx-vlm's
# ``speculative_verify``), keeping their recurrent state per position; a
# plain forward of theirs may swap a layer's cache object mid-pass.
_OWN_VERIFIER = frozenset({"qwen3_5", "qwen3_5_moe"})
_PLAIN = frozenset({"KVCache"})
_WINDOWED = _PLAIN | {"RotatingKVCache"}


def rollback_of(lm: Any) -> Rollback | None:
    """How ``lm``'s batch cache takes back refused drafts; None: it cannot
    (a layer kind none of the rollbacks knows)."""
    layers = importlib.import_module("mlx_vlm.models.cache").make_prompt_cache(lm)
    kinds = {type(c).__name__ for c in layers}
    if kinds <= _PLAIN:
        return Rollback.CUT
    if kinds <= _WINDOWED and not any(getattr(c, "keep", 0) for c in layers):
        return Rollback.WINDOWED
    if _family(lm) in _OWN_VERIFIER and kinds <= _PLAIN | {"ArraysCache"}:
        return Rollback.RECURRENT
    return None


def _family(lm: Any) -> str:
    parts = type(lm).__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" else ""


@dataclass(eq=False)
class VerifyPass:
    """A verify pass run and not yet settled: :meth:`commit` or :meth:`abort`
    it, once.

    Attributes:
        logits: (B, 1 + width, V).
        hidden: The last layer's output (B, 1 + width, H), or the outputs
            of the layers captured side by side, where asked for.
    """

    logits: mx.array
    hidden: mx.array | None
    rollback: Rollback
    cache: list[Any]
    width: int
    transaction: Any = None

    def commit(self, kept: list[int]) -> None:
        """Keep each row's last token and its first ``kept[i]`` drafts."""
        if self.transaction is None:
            cut_back(self.cache, self.width, kept)
            return
        self.transaction.commit([k + 1 for k in kept])
        unmask_if_unpadded(self.cache)

    def abort(self) -> None:
        """Put the cache back as it was before the pass."""
        if self.transaction is not None:
            self.transaction.abort()
        else:
            cut_back(self.cache, self.width, [-1] * len(self.logits))


def verify(
    lm: Any,
    rollback: Rollback,
    inputs: mx.array,
    cache: list[Any],
    kwargs: dict[str, Any],
    *,
    hidden: bool = False,
    capture: Sequence[int] = (),
) -> VerifyPass:
    """Run ``lm`` over ``inputs`` (B, 1 + width) on the batch ``cache``.
    ``hidden``: keep the last layer's output too (the families with native
    drafters give it); ``capture``: keep these layers' outputs instead,
    concatenated (a DFlash drafter's context)."""
    width = int(inputs.shape[1]) - 1
    extra: dict[str, Any] = {}
    if capture:
        extra["capture_layer_ids"] = list(capture)
    elif hidden:
        extra["return_hidden"] = True
    transaction = None
    if rollback is Rollback.RECURRENT:
        output = lm(inputs, cache=cache, speculative_verify=True, **extra, **kwargs)
        transaction = output.gdn_states
    elif rollback is Rollback.WINDOWED:
        state = importlib.import_module("mlx_vlm.speculative.cache_state")
        transaction = state.start_speculative_cache(cache, width + 1)
        try:
            output = lm(inputs, cache=cache, **extra, **kwargs)
        except BaseException:
            transaction.abort()
            raise
    else:
        output = lm(inputs, cache=cache, **extra, **kwargs)
    states = output.hidden_states if extra else None
    kept = None
    if states:
        kept = mx.concatenate(states, axis=-1) if capture else states[-1]
    return VerifyPass(
        output.logits,
        kept,
        rollback,
        cache,
        width,
        transaction,
    )
