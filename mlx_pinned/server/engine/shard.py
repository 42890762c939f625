"""A model's language model split over the ranks of a group, before any
weight is read: mlx-vlm's ``shard()`` where the family has one, else the
Megatron split of :data:`PLANS`. The embeddings, the output head and the
vision tower stay whole. MLX thread only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, cast

__all__ = ["PLANS", "ShardError", "plan", "shard"]


class ShardError(ValueError):
    """The model cannot be split over the group; the message says why."""


def _attention_and_mlp(layers: Iterable[Any], group: Any) -> None:
    """The Megatron split of a dense decoder (mlx-lm's qwen3 ``shard``)."""
    size = group.size()
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            _split(attention, name, "all-to-sharded", group)
        _split(attention, "o_proj", "sharded-to-all", group)
        attention.n_heads //= size
        attention.n_kv_heads //= size
        for name in ("gate_proj", "up_proj"):
            _split(mlp, name, "all-to-sharded", group)
        _split(mlp, "down_proj", "sharded-to-all", group)


def _split(owner: Any, name: str, sharding: str, group: Any) -> None:
    from mlx.nn.layers.distributed import shard_linear

    setattr(owner, name, shard_linear(getattr(owner, name), sharding, group=group))


#: Shard plans for families whose mlx-vlm model has no ``shard()``, by
#: ``model_type``: each is given the language model's decoder layers.
PLANS: dict[str, Callable[[Iterable[Any], Any], None]] = {
    "qwen3_vl": _attention_and_mlp,
    "qwen2_5_vl": _attention_and_mlp,
}


def shard(model: Any, group: Any) -> None:
    """Split ``model``'s language model over ``group``'s ranks, in place; call it
    on a model loaded with ``lazy=True``, before it is evaluated.

    Raises:
        ShardError: As :func:`plan`.
    """
    plan(model, group.size())(group)


def plan(model: Any, size: int) -> Callable[[Any], None]:
    """How ``model`` is split over ``size`` ranks, as a function of the group;
    reads shapes only, so it checks a lazy model before anything is read.

    Raises:
        ShardError: The family has neither a ``shard()`` nor a plan here, or a
            layer's heads or MLP width do not divide by ``size``.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    language = getattr(model, "language_model", model)
    own = getattr(language, "shard", None)
    recipe = PLANS.get(model_type)
    if not callable(own) and recipe is None:
        known = ", ".join([*sorted(PLANS), "the families with a shard() in mlx-vlm"])
        raise ShardError(
            f"the {model_type} family cannot be split for tensor parallelism: "
            f"neither mlx-vlm nor mlx-pinned has a shard plan for it (planned: "
            f"{known}); serve it on one machine"
        )
    layers = list(getattr(language, "layers", ()))
    if not layers:
        raise ShardError(f"the {model_type} model has no decoder layers to split")
    _check_divides(model_type, layers, size)
    if callable(own):
        return cast("Callable[[Any], None]", own)
    assert recipe is not None
    return functools.partial(recipe, layers)


def _check_divides(model_type: str, layers: list[Any], size: int) -> None:
    """An uneven split would give ranks differently shaped parts, and the
    upstream recipes divide the head counts without checking."""
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        widths = {
            "attention heads": getattr(attention, "n_heads", None),
            "KV heads": getattr(attention, "n_kv_heads", None),
        }
        gate = getattr(getattr(layer, "mlp", None), "gate_proj", None)
        weight = getattr(gate, "weight", None)
        if weight is not None:
            widths["MLP width"] = weight.shape[0]
        for what, count in widths.items():
            if isinstance(count, int) and count % size:
                raise ShardError(
                    f"the {model_type} model cannot be split over {size} ranks: "
                    f"layer {index} has {count} {what}, not a multiple of {size}"
                )
