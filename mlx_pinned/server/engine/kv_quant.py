"""The quantized KV cache (``kv_bits``; docs/engine.md, "The quantized KV
cache"): mlx-vlm's own quantized caches, picked per layer by mlx-vlm's
rule, and a check that refuses a model whose cache cannot be. MLX thread
only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..config_checks import SettingError
from .model import LoadedModel

__all__ = [
    "KVQuant",
    "batch_layer",
    "bytes_per_token",
    "check_quantizable",
    "held_bytes",
    "single_caches",
    "to_batch",
]

#: The group sizes ``mx.quantize`` takes that the flags offer.
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVQuant:
    """How the KV cache is quantized: ``bits`` per value, one scale and bias
    per ``group_size`` values of a head."""

    bits: int
    group_size: int = 64


def _cache() -> Any:
    return importlib.import_module("mlx_vlm.models.cache")


def _quantized(index: int, layers: int) -> bool:
    return bool(_cache().should_quantize_kv_layer(index, layers))


def check_quantizable(loaded: LoadedModel, quant: KVQuant) -> None:
    """Refuse a model whose KV cannot be quantized as ``quant`` asks.

    Raises:
        SettingError: A layer keeps a cache other than a plain KV cache, or
            the model's head size is not a multiple of the group size.
    """
    lm = loaded.model.language_model
    name = f"{loaded.path} ({loaded.config.model_type})"
    kinds = sorted(
        {type(c).__name__ for c in _cache().make_prompt_cache(lm)} - {"KVCache"}
    )
    if kinds:
        raise SettingError(
            "kv_bits",
            f"kv_bits (--kv-bits): the model {name} keeps {', '.join(kinds)} "
            "layers, whose KV cannot be quantized here: serve it without "
            "--kv-bits",
        )
    head = _head_size(lm)
    if head is not None and head % quant.group_size:
        fits = " or ".join(str(size) for size in KV_GROUP_SIZES if head % size == 0)
        fix = (
            f"give --kv-group-size {fits}, or serve it without --kv-bits"
            if fits
            else "no group size (32, 64 or 128) divides it: serve it without --kv-bits"
        )
        raise SettingError(
            "kv_group_size",
            f"kv_group_size (--kv-group-size): the model {name} has heads of "
            f"{head} values, not a multiple of {quant.group_size}: {fix}",
        )


def _head_size(lm: Any) -> int | None:
    args = getattr(lm, "args", None) or getattr(lm, "config", None)
    head = getattr(args, "head_dim", None)
    if isinstance(head, int):
        return head
    hidden = getattr(args, "hidden_size", None)
    heads = getattr(args, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads:
        return hidden // heads
    return None


def single_caches(lm: Any, quant: KVQuant | None) -> list[Any]:
    """One sequence's caches: mlx-vlm's own, its plain KV layers quantized (by
    mlx-vlm's rule) under ``quant``."""
    layers = list(_cache().make_prompt_cache(lm))
    if quant is None:
        return layers
    cache = _cache()
    return [
        cache.QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
        if type(layer).__name__ == "KVCache" and _quantized(i, len(layers))
        else layer
        for i, layer in enumerate(layers)
    ]


def batch_layer(index: int, layers: int, pads: list[int], quant: KVQuant | None) -> Any:
    """An empty batch cache for plain KV layer ``index`` of ``layers``,
    quantized where ``quant`` quantizes that layer."""
    cache = _cache()
    if quant is not None and _quantized(index, layers):
        return cache.BatchQuantizedKVCache(
            pads, group_size=quant.group_size, bits=quant.bits
        )
    return cache.BatchKVCache(pads)


def to_batch(layer: Any) -> Any:
    """A one-row batch cache holding a single sequence's ``layer``."""
    if type(layer).__name__ == "QuantizedKVCache":
        # mlx-vlm's own conversion: the packed keys as they are, no rounding.
        return layer.prefix_cache_merge([layer], [layer.offset])
    return type(layer).merge([layer])


def _parts(value: Any) -> list[mx.array]:
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [p for item in value for p in _parts(item)]
    return [value] if isinstance(value, mx.array) else []


def held_bytes(layer: Any) -> int:
    """Bytes one layer's batch cache holds (its whole buffers)."""
    parts = _parts(getattr(layer, "keys", None)) + _parts(
        getattr(layer, "values", None)
    )
    if parts:
        return sum(int(p.nbytes) for p in parts)
    try:
        return int(getattr(layer, "nbytes", 0))
    except NotImplementedError:
        return 0


def bytes_per_token(cache: list[Any]) -> int:
    """Bytes of KV one token takes in ``cache`` (every layer, scales and biases
    included); 0 for an empty cache or one without plain keys and values."""
    total = 0.0
    for layer in cache:
        for part in _parts(getattr(layer, "keys", None)) + _parts(
            getattr(layer, "values", None)
        ):
            if part.ndim != 4 or not part.shape[0] * part.shape[2]:
                return 0
            total += part.nbytes / (part.shape[0] * part.shape[2])
    return round(total)
