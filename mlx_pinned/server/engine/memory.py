"""A model's weight bytes before it loads (its checkpoint's files, for the
``max_model_bytes`` budget), the bytes a token of its KV takes, MLX's
buffer cache limit, and giving an unloaded model's memory back
(:func:`release`). MLX thread only.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .kv_quant import KVQuant, bytes_per_token, single_caches

__all__ = [
    "Released",
    "check_start_up_budget",
    "kv_bytes_per_token",
    "limit_buffer_cache",
    "release",
    "stored_weight_bytes",
]

logger = logging.getLogger("mlx_pinned.server")


def stored_weight_bytes(model_path: str | Path) -> int:
    """Bytes of the model's ``*.safetensors`` files, and those one folder down
    (a speech model's vocoder); a hub id is resolved (downloaded if need be)
    as mlx-vlm's load resolves it.

    Raises:
        FileNotFoundError: The folder holds no ``*.safetensors`` file.
    """
    folder = Path(model_path)
    if not folder.is_dir():
        from mlx_vlm.utils import get_model_path

        folder = Path(get_model_path(str(model_path)))
    files = sorted([*folder.glob("*.safetensors"), *folder.glob("*/*.safetensors")])
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return sum(file.stat().st_size for file in files)


def kv_bytes_per_token(lm: Any, quant: KVQuant | None = None) -> int:
    """Bytes of KV one token takes in the model's cache (every layer, as
    ``quant`` quantizes it), from a one-token forward; 0 where that forward
    fails (the batch measures it once rows join)."""
    try:
        caches = single_caches(lm, quant)
        lm(mx.array([[0]]), cache=caches)
        mx.eval([cache.state for cache in caches])
        return bytes_per_token(caches)
    except Exception:  # a family's forward that needs more than a token
        logger.debug("no one-token forward to measure the KV", exc_info=True)
        return 0


def limit_buffer_cache(limit: int, *, explicit: bool) -> int:
    """Bound MLX's buffer cache (process-wide) to ``limit`` bytes; unless
    ``explicit``, only where MLX's own limit is larger. The limit in force."""
    own = int(mx.set_cache_limit(limit))
    if not explicit and own < limit:
        mx.set_cache_limit(own)
        limit = own
    logger.info("MLX's buffer cache keeps at most %d bytes", limit)
    return limit


def check_start_up_budget(paths: tuple[str, ...], budget: int) -> int:
    """Refuse a start-up whose models would hold more than ``budget`` bytes of
    weights, before any of them loads; their bytes otherwise.

    Raises:
        ValueError: They need more than ``budget``.
    """
    need = sum(stored_weight_bytes(path) for path in paths)
    if need > budget:
        raise ValueError(
            f"the models loaded at start-up hold {need} bytes of weights, more "
            f"than max_model_bytes ({budget}): raise it, or load models on "
            "first use"
        )
    return need


@dataclass(frozen=True)
class Released:
    """MLX's memory around one :func:`release` (bytes)."""

    active_before: int
    active_after: int
    cache_after: int

    @property
    def freed(self) -> int:
        """Active memory given back (0 if something else allocated)."""
        return max(0, self.active_before - self.active_after)


def release(holder: list[Any], name: str = "") -> Released:
    """Free an unloaded model's engine: empty ``holder`` so the last reference
    goes here, collect, and clear MLX's buffer cache. Give the engine in a
    list nothing else keeps: a plain argument would stay referenced by the
    job until it returned."""
    active = mx.get_active_memory()
    holder.clear()
    gc.collect()
    mx.clear_cache()
    released = Released(active, mx.get_active_memory(), mx.get_cache_memory())
    logger.info(
        "released %s: %d bytes of MLX memory given back (active %d -> %d bytes)",
        name or "a model",
        released.freed,
        released.active_before,
        released.active_after,
    )
    return released
