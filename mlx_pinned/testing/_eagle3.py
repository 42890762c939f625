"""An EAGLE-3 drafter beside a damped four-layer tiny Qwen3.5, for tests
and benchmarks. Calling thread.

The model is the tiny Qwen3.5 with its two layers written twice (EAGLE-3
reads three of a model's layers), damped, with its live token embeddings
at one norm, as :mod:`._dflash`'s: it repeats a token until its layers say
otherwise. The drafter's one layer adds nothing (its attention's and its
MLP's outputs are zero), so its hidden state is the model's last layer's
output, picked out by its ``fc``, and its norm and head are the model's:
it drafts what the model would say next, again and again. ``damping``
sets how often the two disagree (0: never). Nothing here is a real model.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Final

from ._dflash import _EMBED, _PREFIX, _WEIGHTS, _write_model
from ._drafters import _load, _save, source_of, write_pair

_LAYERS: Final = _PREFIX + "model.layers."


def make_tiny_eagle3(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str],
    *,
    damping: float = 0.05,
    overwrite: bool = False,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``source`` (the tiny Qwen3.5, ``tiny_vlm_path("qwen3_5")``) with
    its layers twice and damped at ``path``/``model``, and a one-layer
    EAGLE-3 drafter that agrees with it, as the module says, at
    ``path``/``drafter``; their folders. Written, cached and replaced as
    ``make_tiny_vlm`` does.

    Raises:
        ValueError: ``source`` is not a Qwen3.5 model.
    """
    folder = source_of(source, "qwen3_5", "qwen3_5_moe")
    return write_pair(
        path,
        folder,
        "mlx_pinned.testing.make_tiny_eagle3",
        damping,
        lambda model: _write_twice(folder, model, damping),
        _write_drafter,
        overwrite=overwrite,
    )


def _write_twice(source: pathlib.Path, folder: pathlib.Path, damping: float) -> None:
    _write_model(source, folder, damping)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    layers = int(text["num_hidden_layers"])
    text["num_hidden_layers"] = 2 * layers
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    weights = _load(folder / _WEIGHTS)
    for name in [n for n in weights if n.startswith(_LAYERS)]:
        index, rest = name[len(_LAYERS) :].split(".", 1)
        weights[f"{_LAYERS}{int(index) + layers}.{rest}"] = weights[name]
    _save(folder / _WEIGHTS, weights)


def _write_drafter(model: pathlib.Path, folder: pathlib.Path) -> None:
    import numpy as np

    from ._weights import parameter_specs

    text = json.loads((model / "config.json").read_text())["text_config"]
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    vocab = int(text["vocab_size"])
    heads = 4
    capture = [0, layers // 2, layers - 1]
    config = {
        "model_type": "eagle3",
        "draft_vocab_size": vocab,
        "target_hidden_size": hidden,
        "block_size": 4,
        "target_layer_ids": [i + 1 for i in capture],
        "capture_layer_ids": capture,
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": hidden // heads,
            "rms_norm_eps": float(text["rms_norm_eps"]),
            "vocab_size": vocab,
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, folder / name)
    module = "mlx_vlm.speculative.drafters.eagle3"
    specs = parameter_specs(
        module,
        lambda found: found.Model(found.ModelConfig.from_dict(config)),
        kind=f"eagle3-{hidden}",
    )
    weights = _load(model / _WEIGHTS)
    found: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for name, shape in specs:
        if name == "fc.weight":  # the model's last layer, of the three
            value = np.zeros(shape, dtype=np.float32)
            value[:, 2 * hidden :] = np.eye(hidden, dtype=np.float32)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            value = np.zeros(shape, dtype=np.float32)
        elif name in ("lm_head.weight", "embed_tokens.weight"):
            value = weights[_EMBED]  # the model's head: tied
        elif name == "norm.weight":
            value = weights[_PREFIX + "model.norm.weight"]
        elif len(shape) > 1:
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
        else:
            value = np.ones(shape, dtype=np.float32)
        found[name] = value
    _save(folder / _WEIGHTS, found)
