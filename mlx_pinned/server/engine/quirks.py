"""mlx-vlm's quirks, worked around in one place (MLX thread only): the
attention mask ``BatchKVCache`` builds for every one-token step, which
caches can be cut back a token, and the rope deltas Qwen-VL models keep on
the model.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any, cast

import mlx.core as mx

__all__ = [
    "cache_kinds",
    "cut_back",
    "cut_back_caches",
    "rope_deltas",
    "row_rope_deltas",
    "uncuttable_kinds",
    "unmask_if_unpadded",
]


def cache_kinds(lm: Any) -> list[str]:
    """The kinds of a language model's layer caches (one sequence's), sorted."""
    return sorted({type(c).__name__ for c in _cache_module().make_prompt_cache(lm)})


def uncuttable_kinds(lm: Any) -> list[str]:
    """The kinds of a language model's layer caches, sorted, when one is not a
    plain ``KVCache`` (its KV cannot be cut at any token); else empty."""
    kinds = cache_kinds(lm)
    return [] if kinds == ["KVCache"] else kinds


def cut_back_caches(layers: Iterable[Any]) -> bool:
    """Whether ``trim`` can cut every layer's batch cache back."""
    return all(type(c).__name__ in _CUT_BACK for c in layers)


_CUT_BACK = frozenset({"BatchKVCache", "BatchQuantizedKVCache"})


def unmask_if_unpadded(cache: list[Any] | None) -> None:
    """Let one-token steps skip the attention mask while no row is padded.

    ``BatchKVCache`` builds a mask every step to hide left padding, all
    true once there is none, and attention with a mask array is the slower
    kernel. The model asks the first layer's cache for the mask, so only
    that cache answers None; call it when rows join or leave.
    """
    first = cache[0] if cache else None
    # A recurrent layer's state (Qwen3.5) has no padding to read.
    if first is None or getattr(first, "left_padding", None) is None:
        return
    first.__dict__.pop("make_mask", None)  # the class's own, masking
    if not any(cast("list[int]", first.left_padding.tolist())):
        first.make_mask = _unmasked_steps(first.make_mask)


def _unmasked_steps(make_mask: Any) -> Any:
    def make(n: int, *args: Any, **kwargs: Any) -> Any:
        return None if n == 1 else make_mask(n, *args, **kwargs)

    return make


def row_rope_deltas(
    lm: Any, kwargs: dict[str, Any], pads: list[int], *, media: bool
) -> mx.array | None:
    """Each row's rope delta (rows, 1) after a batched prefill of rows
    left-padded by ``pads``: without media mlx-vlm counts the padding in it,
    which the batch cache's offsets leave out, so it is added back."""
    deltas = rope_deltas(lm, kwargs, len(pads))
    if deltas is not None and not media:
        deltas = deltas + mx.array(pads, dtype=deltas.dtype)[:, None]
    return deltas


def rope_deltas(lm: Any, kwargs: dict[str, Any], rows: int) -> mx.array | None:
    """Per-row rope deltas (rows, 1) for models that keep them on the model."""
    if not hasattr(lm, "_rope_deltas"):
        return None
    delta = kwargs.get("rope_deltas")
    if not isinstance(delta, mx.array):
        delta = lm._rope_deltas
    if delta is None:
        return mx.zeros((rows, 1), dtype=mx.int32)
    return delta.reshape(-1, 1)[:rows]


def _cache_module() -> Any:
    return importlib.import_module("mlx_vlm.models.cache")


def cut_back(cache: Sequence[Any], width: int, kept: Sequence[int]) -> None:
    """Drop each row's positions past its kept drafts: ``width`` were written
    per row, row ``i`` keeps ``kept[i]``; the rest is rolled to its left
    padding."""
    most = max(kept)
    if width > most:
        for c in cache:
            c.trim(width - most)
    if most == min(kept):
        return
    assert cut_back_caches(cache)
    # The rest rolled to the row's left, where its left padding hides it.
    shift = mx.array([most - k for k in kept], dtype=mx.int32)
    for c in cache:
        keys, values, offset, padding = c.state
        length = keys.shape[2]
        index = (mx.arange(length, dtype=mx.int32)[None, :] - shift[:, None]) % length
        c.state = (
            _roll(keys, index),
            _roll(values, index),
            offset - shift,
            padding + shift,
        )
    unmask_if_unpadded(list(cache))


def _roll(array: mx.array, index: mx.array) -> mx.array:
    batch, heads, length, dim = array.shape
    full = mx.broadcast_to(index[:, None, :, None], (batch, heads, length, dim))
    return mx.take_along_axis(array, full, axis=2)
