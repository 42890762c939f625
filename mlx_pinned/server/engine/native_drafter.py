"""Native drafters: one of mlx-vlm's drafter classes that the served
checkpoint carries (Qwen3.5's MTP layers) or that is given beside it
(Gemma 4's assistant), drafting for the batch's rows together from the
served model's last hidden state; a DFlash or EAGLE-3 drafter given beside
it is loaded here and drafts through :mod:`.dflash_drafter` and
:mod:`.eagle3_drafter`. MLX thread only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ..config_checks import SettingError
from .dflash_drafter import DFlashDrafter
from .eagle3_drafter import Eagle3Drafter

if TYPE_CHECKING:
    from .model import LoadedModel
    from .rows import Row
    from .state import BatchState

__all__ = ["NativeDrafter", "carries_mtp", "native_kind"]

# The round loops of mlx-vlm's drafters that draft here: "mtp", drafters
# that take the served model's last hidden state and the token after it;
# "dflash" and "eagle3", those that take its hidden states at several
# layers (:mod:`.dflash_drafter`, :mod:`.eagle3_drafter`).
_DRAFTING_KINDS = frozenset({"mtp", "dflash", "eagle3"})
_ASSISTANT_MASKS = "mlx_vlm.speculative.drafters.gemma4_assistant.masks"


def _local(path: str | Path) -> Path:
    utils = importlib.import_module("mlx_vlm.utils")
    return cast("Path", utils.get_model_path(str(path)))


def _config(path: str | Path) -> dict[str, Any]:
    try:
        found = json.loads((_local(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def native_kind(path: str | Path) -> str | None:
    """The round loop of mlx-vlm's that a drafter folder needs (``mtp``,
    ``dflash``, ``eagle3``), from its config; None: a plain model."""
    config = _config(path)
    drafters = importlib.import_module("mlx_vlm.speculative.drafters")
    kinds = drafters.DRAFTER_KIND_BY_MODEL_TYPE
    kind = kinds.get(config.get("model_type"))
    if kind is None and config:
        # As mlx-vlm's loader finds the class: a DFlash drafter declares the
        # family it drafts for (``qwen3`` and a ``dflash_config``).
        found = importlib.import_module("mlx_vlm.utils").get_model_type(config)
        if found is not None and _is_drafter_module(found):
            kind = kinds.get(found, drafters.DEFAULT_DRAFTER_KIND)
    return cast("str | None", kind)


def _is_drafter_module(model_type: str) -> bool:
    find = importlib.util.find_spec
    return (
        find(f"mlx_vlm.models.{model_type}") is None
        and find(f"mlx_vlm.speculative.drafters.{model_type}") is not None
    )


def carries_mtp(path: str | Path) -> bool:
    """Whether a model's checkpoint holds MTP layers mlx-vlm can split off."""
    split = importlib.import_module("mlx_vlm.speculative.drafters.mtp_split")
    try:
        local = _local(path)
    except Exception:
        return False
    return split.detect_mtp_splitter(local) is not None


class NativeDrafter:
    """Drafts with an mlx-vlm drafter of the ``mtp`` kind; a
    :class:`~.drafting.DraftSource`.

    A step's drafts start from each row's last token and the served model's
    last-layer output at the token before it, kept by the passes of
    ``batch``'s decoder (``wants_hidden``); a row without one (new to the
    batch) drafts nothing that step. Each step drafts afresh: the drafter's
    own cache holds only that step's drafts, not the row's history.
    """

    wants_hidden = True

    def __init__(self, drafter: Any, loaded: LoadedModel, batch: BatchState) -> None:
        from mlx.utils import tree_flatten

        self.drafter = drafter
        self.lm: Any = loaded.model.language_model
        self.batch = batch
        self.vocab_size = loaded.vocab_size
        # It attends to the model's last keys and values (Gemma 4's assistant).
        self.shared = hasattr(drafter, "_shared_kv")
        flat = cast("list[tuple[str, mx.array]]", tree_flatten(drafter.parameters()))
        self.weight_bytes = sum(int(v.nbytes) for _, v in flat)
        drafter.bind(loaded.model)

    @classmethod
    def load(
        cls, loaded: LoadedModel, batch: BatchState, path: str | Path | None = None
    ) -> NativeDrafter | DFlashDrafter:
        """The drafter at ``path``, or the one ``loaded``'s checkpoint carries.

        Raises:
            SettingError: It is not a drafter of a kind that drafts here, or
                not one for this model.
        """
        setting = "mtp" if path is None else "draft_model"
        if path is None and not carries_mtp(loaded.path):
            raise SettingError(
                "mtp", f"mtp: {loaded.path} carries no MTP layers to draft with"
            )
        # Refused before its weights load, where its config names its kind.
        named = None if path is None else native_kind(path)
        if named is not None and named not in _DRAFTING_KINDS:
            raise _unknown(setting, path, named)
        drafters = importlib.import_module("mlx_vlm.speculative.drafters")
        drafter, kind = drafters.load_drafter(
            str(loaded.path if path is None else path)
        )
        if kind not in _DRAFTING_KINDS:
            raise _unknown(setting, path, kind)
        try:
            drafters.validate_drafter_compatibility(loaded.model, drafter, kind)
        except ValueError as exc:
            raise SettingError(setting, f"{setting}: {exc}") from None
        if hasattr(drafter, "_shared_kv") and batch.kv_quant is not None:
            raise SettingError(
                setting,
                f"{setting}: {path} attends to the model's keys and values, "
                "which kv_bits packs: serve it without kv_bits",
            )
        mx.eval(drafter.parameters())
        if kind == "dflash":
            return DFlashDrafter.checked(drafter, loaded, path)
        if kind == "eagle3":
            return Eagle3Drafter.checked(drafter, loaded, path)
        return cls(drafter, loaded, batch)

    def propose(self, rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
        most = max(counts, default=0)
        hidden, has = self._hidden(rows)
        if most < 1 or hidden is None or not any(has):
            return [[] for _ in rows]
        drafter, lm = self.drafter, self.lm
        prepare = getattr(lm, "speculative_draft_hidden", None)
        if callable(prepare):
            hidden = prepare(hidden)
        cache = self.batch.cache or []
        lengths = _positions(cache, len(rows))
        shared = _shared_kv(lm, cache) if self.shared else {}
        # Every row's own cache starts empty, so they advance together: no
        # padding (a batch cache's per-row masks cost more than its passes).
        drafter.reset(lm)
        drafter.set_shared_kv(
            shared,
            kv_offset=cast("int", lengths.max().item()),
            position=mx.maximum(lengths - 1, 0),
            kv_valid_len=lengths,
        )
        last = mx.array([row.token for row in rows], dtype=mx.int32)
        drafts = drafter.draft_block(last, hidden, None, most + 1, _greedy, greedy=True)
        found = cast("list[list[int]]", drafts.astype(mx.int32).tolist())
        return [
            self._valid(d[:count]) if ok else []
            for d, count, ok in zip(found, counts, has, strict=True)
        ]

    def settle(self, rows: Sequence[Row], kept: Sequence[int]) -> None:
        """Nothing to cut back: each step drafts afresh."""

    def reset(self) -> None:
        """Nothing kept between steps to forget."""

    def _valid(self, drafts: list[int]) -> list[int]:
        for i, token in enumerate(drafts):
            if token >= self.vocab_size:
                return drafts[:i]
        return drafts

    def _hidden(self, rows: Sequence[Row]) -> tuple[mx.array | None, list[bool]]:
        """The last hidden state of each of ``rows`` (B, 1, H), zero for those
        without one, and which have one."""
        kept = self.batch.decoder.hidden
        if kept is None:
            return None, [False] * len(rows)
        held, hidden = kept
        if list(held) == list(rows):
            return hidden, [True] * len(rows)
        where = {row: i for i, row in enumerate(held)}
        has = [row in where for row in rows]
        if not any(has):
            return None, has
        index = mx.array([where.get(row, 0) for row in rows], dtype=mx.int32)
        picked = hidden[index]
        mask = mx.array(has)[:, None, None]
        return mx.where(mask, picked, mx.zeros_like(picked)), has


def _unknown(setting: str, path: object, kind: str) -> SettingError:
    return SettingError(
        setting,
        f"{setting}: {path} is a {kind} drafter; only drafters of the "
        f"kinds {', '.join(sorted(_DRAFTING_KINDS))} draft in the batch",
    )


def _greedy(logits: mx.array) -> mx.array:
    """A drafter's sampler: greedy drafts are one-hot, which the verify pass
    keeps or refuses exactly, sampled rows too."""
    return mx.argmax(logits, axis=-1)


def _positions(cache: Sequence[Any], rows: int) -> mx.array:
    """Each row's tokens in the batch cache: the position of its last token's
    successor."""
    for layer in cache:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, mx.array) and offset.size == rows:
            return offset.astype(mx.int32)
    return mx.zeros((rows,), dtype=mx.int32)


def _shared_kv(lm: Any, cache: Sequence[Any]) -> dict[str, tuple[mx.array, mx.array]]:
    """The keys and values of the last layer of each attention kind, each
    row's own tokens first and zeros after them (what Gemma 4's assistant
    attends to, as mlx-vlm's ``normalize_batched_shared_kv_states`` lays it
    out)."""
    masks = importlib.import_module(_ASSISTANT_MASKS)
    found: dict[str, tuple[mx.array, mx.array]] = {}
    for layer, held in zip(lm.model.layers, cache, strict=False):
        keys, values = held.keys, held.values
        if keys is None:
            continue
        offset = held.offset.astype(mx.int32)
        size = getattr(held, "max_size", None)
        if size is None:  # plain: its written positions, left-padded
            keys, values = keys[..., : held._idx, :], values[..., : held._idx, :]
            valid, padding = offset, held.left_padding.astype(mx.int32)
        else:  # a sliding window: its slots in time order
            if held.rotated:
                keys = mx.roll(keys, -held._idx, 2)
                values = mx.roll(values, -held._idx, 2)
            window = min(held._offset, size)
            keys, values = keys[..., :window, :], values[..., :window, :]
            valid = mx.minimum(offset, window)
            padding = window - valid
        found.update(
            masks.normalize_batched_shared_kv_states(
                {layer.layer_type: (keys, values)}, valid, padding
            )
        )
    return found
