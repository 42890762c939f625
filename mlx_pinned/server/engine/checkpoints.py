"""One sequence's cache at a token position, as the prompt cache keeps it:
a plain KV layer as its keys and values (cut at any token later), every
other layer (a sliding window, a recurrent state) as mlx-vlm's snapshot of
it, valid at that position only (docs/caching.md, "Checkpoints"). The
snapshots are mlx-vlm's own (``mlx_vlm.apc_adapters``). MLX thread only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

__all__ = [
    "Marks",
    "Prefix",
    "State",
    "StateCheck",
    "check",
    "decode",
    "encode",
    "kinds",
    "no_states",
    "restore",
    "take",
    "tree_arrays",
]

#: One layer's keys or values, (1, H, T, D): an array, or under ``kv_bits``
#: the tuple ``mx.quantize`` makes (packed values, scales, biases).
Part = Any
#: The cache classes kept as keys and values, cut at any token.
PLAIN = frozenset({"KVCache", "QuantizedKVCache"})


def _adapters() -> Any:
    return importlib.import_module("mlx_vlm.apc_adapters")


@dataclass(frozen=True, eq=False)
class State:
    """A layer that is not plain KV, at one position: mlx-vlm's snapshot of
    it (``prefix_cache_snapshot``: its arrays, copied, and its meta state)."""

    payload: Any

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in tree_arrays(self.payload))


#: A layer at a position: its keys and values, or its state.
Layer = tuple[Part, Part] | State
#: An entry's states at each of its positions kept (None: a KV layer).
Marks = dict[int, list[State | None]]
#: Raises ValueError for a state (of layer ``index``, at ``position``) the
#: model's layer cannot take.
StateCheck = Callable[[int, State, int], None]


@dataclass(frozen=True, eq=False)
class Prefix:
    """A prompt's first ``length`` tokens from the prompt cache, per layer."""

    length: int
    layers: list[Layer]


def kinds(layers: Sequence[Any]) -> tuple[bool, ...] | None:
    """Per layer of one sequence's fresh caches, whether it is plain KV (else
    kept as a state); None when mlx-vlm cannot snapshot one of them."""
    plan = _adapters().build_prefix_cache_plan_from_caches(list(layers))
    if not plan.restorable:
        return None
    return tuple(type(layer).__name__ in PLAIN for layer in layers)


def take(caches: Sequence[Any], index: int | None) -> tuple[int, list[Layer]] | None:
    """Row ``index`` of batch caches (None: single-sequence caches): its token
    count and each layer; None when no layer tells the count."""
    layers = [c if index is None else c.extract(index) for c in caches]
    counts = [c.offset for c in layers if isinstance(getattr(c, "offset", None), int)]
    if not counts:
        return None
    tokens = counts[0]
    adapter = _adapters().CheckpointAdapter()
    taken: list[Layer] = []
    for layer in layers:
        if type(layer).__name__ in PLAIN:
            taken.append((layer.keys, layer.values))
        else:
            taken.append(State(adapter.capture(layer, tokens).payload))
    return tokens, taken


def restore(caches: Sequence[Any], prefix: Prefix) -> None:
    """Put ``prefix`` into fresh single-sequence ``caches``. The arrays are
    given as new objects: a cache writes into its arrays in place."""
    adapter = _adapters().CheckpointAdapter()
    fragment = _adapters().StateFragment
    for cache, layer in zip(caches, prefix.layers, strict=True):
        if isinstance(layer, State):
            adapter.restore(cache, fragment(_fresh(layer.payload)))
        else:
            cache.keys, cache.values = layer
            cache.offset = prefix.length


def tree_arrays(tree: Any) -> list[mx.array]:
    """The arrays of a snapshot's tree, depth first."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (tuple, list)):
        return [a for item in tree for a in tree_arrays(item)]
    return []


def _fresh(tree: Any) -> Any:
    if isinstance(tree, mx.array):
        return mx.array(tree)
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_fresh(item) for item in tree)
    return tree


def encode(tree: Any, arrays: list[mx.array]) -> Any:
    """A snapshot's tree as JSON, its arrays appended to ``arrays`` (each
    named by its index there)."""
    if isinstance(tree, mx.array):
        arrays.append(tree)
        return {"array": len(arrays) - 1}
    if isinstance(tree, dict):
        return {"dict": {str(k): encode(v, arrays) for k, v in tree.items()}}
    if isinstance(tree, (tuple, list)):
        name = "tuple" if isinstance(tree, tuple) else "list"
        return {name: [encode(item, arrays) for item in tree]}
    if tree is None or isinstance(tree, str):
        return tree
    raise TypeError(f"a snapshot holds a {type(tree).__name__}")


_DEPTH = 8


def decode(spec: Any, arrays: Sequence[mx.array], taken: list[int]) -> Any:
    """The tree :func:`encode` wrote, holding the next of ``arrays`` in order
    (``taken[0]``: how many the trees before it held; counted on).

    Raises:
        ValueError: ``spec`` is not such a tree, or names its arrays out of
            order.
    """
    return _decode(spec, arrays, taken, 0)


def _decode(spec: Any, arrays: Sequence[mx.array], taken: list[int], depth: int) -> Any:
    if spec is None or isinstance(spec, str):
        return spec
    if depth > _DEPTH or not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError("its state is not a snapshot")
    ((kind, value),) = spec.items()
    if kind == "array":
        if type(value) is not int or value != taken[0] or value >= len(arrays):
            raise ValueError("its state names its arrays out of order")
        taken[0] += 1
        return arrays[value]
    if kind == "dict" and isinstance(value, dict):
        return {k: _decode(v, arrays, taken, depth + 1) for k, v in value.items()}
    if kind in ("tuple", "list") and isinstance(value, list):
        items = [_decode(item, arrays, taken, depth + 1) for item in value]
        return tuple(items) if kind == "tuple" else items
    raise ValueError("its state is not a snapshot")


def check(fresh: Any, state: State, position: int) -> None:
    """Whether ``state`` (read from a file) is one of the layer ``fresh`` (a
    fresh cache of the model's) at ``position``: restored into it, it keeps
    the model's window and the position.

    Raises:
        ValueError: It is not.
    """
    if any(a.ndim < 1 or a.shape[0] != 1 for a in tree_arrays(state.payload)):
        raise ValueError("its state is not one sequence's")
    window = [getattr(fresh, name, None) for name in ("keep", "max_size")]
    size = len(getattr(fresh, "cache", ()) or ())
    try:
        restore([fresh], Prefix(position, [state]))
    except Exception as exc:
        raise ValueError(f"its state does not restore ({exc!r})") from None
    if [getattr(fresh, name, None) for name in ("keep", "max_size")] != window:
        raise ValueError("its state is of another window")
    if getattr(fresh, "offset", position) != position:
        raise ValueError("its state is at another position than its mark")
    if hasattr(fresh, "cache") and (
        not isinstance(fresh.cache, list)
        or len(fresh.cache) != size
        or not all(a is None or isinstance(a, mx.array) for a in fresh.cache)
    ):
        raise ValueError("its state has other arrays than the layer's")
    if hasattr(fresh, "keys") and not _kv_like(fresh):
        raise ValueError("its state's keys and values do not match")


def _kv_like(cache: Any) -> bool:
    keys, values = cache.keys, cache.values
    return (
        isinstance(keys, mx.array)
        and isinstance(values, mx.array)
        and keys.ndim == values.ndim == 4
        and keys.shape[2] == values.shape[2]
        and 0 <= getattr(cache, "_idx", 0) <= keys.shape[2]
    )


def no_states(index: int, state: State, position: int) -> None:
    """:func:`check` for a model that keeps no states."""
    raise ValueError("this model keeps no states")


def checker(lm: Any) -> StateCheck:
    """:func:`check` for the layers of ``lm``'s cache, by index."""

    def check_layer(index: int, state: State, position: int) -> None:
        layers = importlib.import_module("mlx_vlm.models.cache").make_prompt_cache(lm)
        if not 0 <= index < len(layers):
            raise ValueError("its state is of a layer the model does not have")
        check(layers[index], state, position)

    return check_layer
