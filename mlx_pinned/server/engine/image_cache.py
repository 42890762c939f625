"""The image cache (docs/caching.md): the vision tower's output per image,
reused across requests and turns. :class:`CachedVisionTower` stands in
for the tower and encodes only the images it does not hold (the tower
encodes each image alone, so the output is the same). MLX thread only.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

if TYPE_CHECKING:
    from .prompt_disk import DiskTier

__all__ = ["CachedVisionTower", "install"]

# Families whose tower takes (pixels, grid_thw) and gives rows per image in
# grid order, t * h * w / merge**2 of them (and deepstack features alike),
# and whose cached answers the tests compare with uncached ones.
_GRID_TOWERS = frozenset({"qwen3_vl", "qwen3_5"})
# Families whose tower takes a batch of same-size images (N, H, W, C) and
# gives its output per image along the first axis (the first of three).
_BATCH_TOWERS = frozenset({"gemma3"})

#: An image's outputs: its features, and its deepstack features (None: the
#: tower has none).
Output = tuple[mx.array, list[mx.array] | None]


class _Held:
    """The outputs by key, least recently used first. A plain object: an
    ``nn.Module`` would take a dict attribute for weights."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.outputs: OrderedDict[bytes, Output] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.disk_hits = 0  # of the hits, images read from the disk tier


class CachedVisionTower(nn.Module):  # type: ignore[misc,name-defined]
    """A vision tower with a cache of its per-image outputs, within ``budget``
    bytes. ``merge``: its spatial merge size (an image's output rows are its
    pixel rows over ``merge**2``; 0: a batch tower, an image a row of its
    pixels and of its output); ``disk``: where outputs are also kept."""

    def __init__(self, tower: Any, merge: int, budget: int) -> None:
        super().__init__()
        self.tower = tower
        self.merge = merge
        self.held = _Held(budget)
        self.disk: DiskTier | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the tower's own attributes (patch_embed, ...)
            tower = self.get("tower")
            if tower is None:
                raise
            return getattr(tower, name)

    def attach(self, disk: DiskTier) -> None:
        """Write each image's outputs to ``disk`` too, and look one up there before
        encoding it."""
        if disk.enabled:
            self.disk = disk

    def __call__(self, pixels: mx.array, grid_thw: Any = None, **kwargs: Any) -> Any:
        if self.merge == 0:
            args = () if grid_thw is None else (grid_thw,)
            return self._batch(pixels, *args, **kwargs)
        rows = cast("list[list[int]]", grid_thw.tolist())
        grids = [tuple(int(v) for v in row) for row in rows]
        sizes = [t * h * w for t, h, w in grids]
        starts = np.cumsum([0, *sizes]).tolist()
        keys = [
            _key(pixels[a:b], grid)
            for a, b, grid in zip(starts[:-1], starts[1:], grids, strict=True)
        ]
        parts = [
            self._find(key, size // self.merge**2)
            for key, size in zip(keys, sizes, strict=True)
        ]
        missing = [i for i, part in enumerate(parts) if part is None]
        self.held.hits += len(keys) - len(missing)
        self.held.misses += len(missing)
        if missing:
            encoded = self._encode(pixels, grid_thw, starts, missing, **kwargs)
            for i, part in zip(missing, encoded, strict=True):
                parts[i] = part
                self._hold(keys[i], part)
                if self.disk is not None:
                    self.disk.save_image(keys[i], part)
        found = cast("list[Output]", parts)
        features = mx.concatenate([f for f, _ in found])
        if found[0][1] is None:
            return features
        deep = [
            mx.concatenate([d[layer] for _, d in found if d is not None])
            for layer in range(len(found[0][1]))
        ]
        return features, deep

    def _batch(self, pixels: mx.array, *args: Any, **kwargs: Any) -> Any:
        """A batch tower's call: its images one by one along the first axis."""
        keys = [_key(pixels[i], ()) for i in range(pixels.shape[0])]
        parts = [self._find(key, 1) for key in keys]
        missing = [i for i, part in enumerate(parts) if part is None]
        self.held.hits += len(keys) - len(missing)
        self.held.misses += len(missing)
        if missing:
            index = mx.array(missing, dtype=mx.int32)
            features = self.tower(pixels[index], *args, **kwargs)[0]
            mx.eval(features)
            for n, i in enumerate(missing):
                parts[i] = (features[n : n + 1], None)
                self._hold(keys[i], (features[n : n + 1], None))
                if self.disk is not None:
                    self.disk.save_image(keys[i], (features[n : n + 1], None))
        found = cast("list[Output]", parts)
        # Gemma 3's three outputs; it reads only the first.
        return mx.concatenate([f for f, _ in found]), None, None

    def _find(self, key: bytes, rows: int) -> Output | None:
        """An image's outputs, held or (then held) on disk; None: neither."""
        output = self.held.outputs.get(key)
        if output is not None:
            self.held.outputs.move_to_end(key)
        elif self.disk is not None:
            output = self.disk.load_image(key, rows)
            if output is not None:
                self.held.disk_hits += 1
                self._hold(key, output)
        return output

    def _encode(
        self,
        pixels: mx.array,
        grid_thw: mx.array,
        starts: list[int],
        missing: list[int],
        **kwargs: Any,
    ) -> list[Output]:
        rows = mx.concatenate([pixels[starts[i] : starts[i + 1]] for i in missing])
        grids = grid_thw[mx.array(missing, dtype=mx.int32)]
        output = self.tower(rows, grids, **kwargs)
        features, deep = output if isinstance(output, tuple) else (output, None)
        cut = np.cumsum(
            [0, *((starts[i + 1] - starts[i]) // self.merge**2 for i in missing)]
        ).tolist()
        outputs: list[Output] = [
            (features[a:b], None if deep is None else [d[a:b] for d in deep])
            for a, b in itertools.pairwise(cut)
        ]
        mx.eval(outputs)
        return outputs

    def _hold(self, key: bytes, value: Output) -> None:
        held = self.held
        held.outputs[key] = value
        held.bytes += _size(value)
        while held.bytes > held.budget and len(held.outputs) > 1:
            _, old = held.outputs.popitem(last=False)
            held.bytes -= _size(old)


def _size(value: Output) -> int:
    features, deep = value
    return int(features.nbytes + sum(d.nbytes for d in deep or ()))


def _key(pixels: mx.array, grid: tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(grid).encode())
    if pixels.dtype == mx.bfloat16:  # NumPy has no bfloat16: hash its bits
        pixels = pixels.view(mx.uint16)
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.digest()


def install(model: Any, budget: int) -> CachedVisionTower | None:
    """Put a :class:`CachedVisionTower` in place of ``model``'s tower, if its
    family's outputs follow ``grid_thw`` and ``budget`` > 0."""
    config = model.config
    tower = getattr(model, "vision_tower", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 0)
    family = getattr(config, "model_type", None)
    if budget <= 0 or tower is None:
        return None
    if family in _BATCH_TOWERS:
        merge = 0  # a batch tower's: no grid
    elif family not in _GRID_TOWERS or not merge:
        return None
    cached = CachedVisionTower(tower, int(merge), budget)
    model.vision_tower = cached
    return cached
