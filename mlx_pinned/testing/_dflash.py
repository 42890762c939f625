"""A DFlash drafter beside a damped tiny Qwen3.5, for tests and benchmarks.
Calling thread.

The model's live token embeddings are scaled to one norm, so its tied head
maps each token to itself, and its layers are damped (outputs scaled by
``damping``): it repeats a token until its layers say otherwise. The
drafter's one layer reads nothing of the model's hidden states (its ``fc``
is zero) and its queries are zero, so every masked position of a block
attends evenly to the block's first token (the only non-zero value: the
mask token's embedding is zero), and its head, the model's, drafts that
token again. ``damping`` sets how often the two disagree (0: never).
Nothing here is a real model.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Final

from ._drafters import _copy_files, _load, _save, source_of, write_pair

_PREFIX: Final = "language_model."
_WEIGHTS: Final = "model.safetensors"
_OUTPUTS: Final = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_EMBED: Final = _PREFIX + "model.embed_tokens.weight"


def make_tiny_dflash(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str],
    *,
    damping: float = 0.05,
    overwrite: bool = False,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``source`` (a Qwen3.5 folder, such as ``tiny_vlm_path("qwen3_5")``)
    damped at ``path``/``model`` and a one-layer DFlash drafter that agrees
    with it, as the module says, at ``path``/``drafter``; their folders.
    Written, cached and replaced as ``make_tiny_vlm`` does.

    Raises:
        ValueError: ``source`` is not a Qwen3.5 model.
    """
    folder = source_of(source, "qwen3_5", "qwen3_5_moe")
    return write_pair(
        path,
        folder,
        "mlx_pinned.testing.make_tiny_dflash",
        damping,
        lambda model: _write_model(folder, model, damping),
        _write_drafter,
        overwrite=overwrite,
    )


def _write_model(source: pathlib.Path, folder: pathlib.Path, damping: float) -> None:
    import numpy as np

    _copy_files(source, folder)
    weights = _load(source / _WEIGHTS)
    embed = weights[_EMBED]
    norms = np.linalg.norm(embed, axis=1, keepdims=True)
    live = norms[:, 0] > 0
    # One norm: a token's own row is the nearest to its embedding.
    embed[live] *= norms[live].mean() / norms[live]
    if live.all():  # the drafter's mask token: one the model never says
        embed[-1] = 0
    weights[_EMBED] = embed
    for name in list(weights):
        if name.startswith(_PREFIX + "model.layers.") and name.endswith(_OUTPUTS):
            weights[name] = weights[name] * np.float32(damping)
    _save(folder / _WEIGHTS, weights)


def _write_drafter(model: pathlib.Path, folder: pathlib.Path) -> None:
    import numpy as np

    from ._weights import parameter_specs

    text = json.loads((model / "config.json").read_text())["text_config"]
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    weights = _load(model / _WEIGHTS)
    embed = weights[_EMBED]
    heads = 4
    config = {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        # As many key-value heads as query heads: the values carry the
        # whole embedding.
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": float(text["rms_norm_eps"]),
        "vocab_size": int(text["vocab_size"]),
        "rope_theta": 10000000.0,
        "tie_word_embeddings": True,
        "block_size": 4,
        "num_target_layers": layers,
        "dflash_config": {
            # A token whose embedding is zero (one the model never says).
            "mask_token_id": int(np.flatnonzero(~embed.any(axis=1))[-1]),
            "target_layer_ids": list(range(layers)),
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, folder / name)
    module = "mlx_vlm.speculative.drafters.qwen3_dflash"
    specs = parameter_specs(
        module,
        lambda found: found.Model(found.ModelConfig.from_dict(config)),
        kind=f"dflash-{hidden}",
    )
    found: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for name, shape in specs:
        if name.endswith(("v_proj.weight", "o_proj.weight")):
            value = np.eye(hidden, dtype=np.float32)
        elif name.endswith(("fc.weight", "q_proj.weight", "down_proj.weight")):
            value = np.zeros(shape, dtype=np.float32)
        elif name == "norm.weight":
            value = weights[_PREFIX + "model.norm.weight"]
        elif len(shape) > 1:
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
        else:
            value = np.ones(shape, dtype=np.float32)
        found[name] = value
    _save(folder / _WEIGHTS, found)
