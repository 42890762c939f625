"""Models with a native drafter, written from a model folder of this
package, for tests and benchmarks: a Qwen3.5 whose checkpoint holds MTP
layers (``mtp.*`` weights and ``mtp_num_hidden_layers``, as mlx-vlm's
splitter reads them), and a Gemma 4 with an assistant. Calling thread.

The drafter agrees with its model on most tokens, as a trained one does:
the model's layers are damped (their outputs scaled by ``damping``), so its
next token depends mostly on its current one; the drafter's layers pass
their input through (zero outputs) and so compute that same map. Qwen3.5's
LM head maps each token to the next of one long cycle through the
vocabulary; Gemma 4's is its embedding (tied), so each token maps to
itself: the model repeats a token until its layers say otherwise.
``damping`` sets how often model and drafter disagree (0: never). Nothing
here is a real model.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any, Final

from ._install import write_folder

FORMAT: Final = 1
_PREFIX: Final = "language_model."
_WEIGHTS: Final = "model.safetensors"
# The projections whose output joins a layer's residual: scaled by damping.
_OUTPUTS: Final = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_GEMMA_OUTPUTS: Final = (
    "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight",
)


def make_tiny_mtp(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str],
    *,
    damping: float = 0.05,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write ``source`` (a Qwen3.5 folder, such as ``tiny_vlm_path("qwen3_5")``)
    at ``path`` with one MTP layer in its checkpoint, agreeing with it as the
    module says; written, cached and replaced as ``make_tiny_vlm`` does.

    Args:
        damping: Scales the model's layer outputs (0 to 1).
        seed: Seeds the cycle of the LM head.

    Raises:
        ValueError: ``source`` is not a Qwen3.5 model.
    """
    source = source_of(source, "qwen3_5", "qwen3_5_moe")
    marker = {
        "format": FORMAT,
        "generator": "mlx_pinned.testing.make_tiny_mtp",
        "source": _marker_of(source),
        "damping": damping,
        "seed": seed,
    }
    return write_folder(
        pathlib.Path(path),
        lambda sizes: {**marker, "files": sizes},
        lambda folder: _write_mtp(source, folder, damping, seed),
        overwrite=overwrite,
    )


def write_pair(
    path: str | os.PathLike[str],
    source: pathlib.Path,
    generator: str,
    damping: float,
    model: Callable[[pathlib.Path], None],
    drafter: Callable[[pathlib.Path, pathlib.Path], None],
    *,
    overwrite: bool,
    drafter_folder: str = "drafter",
) -> tuple[pathlib.Path, pathlib.Path]:
    """A model written by ``model(folder)`` at ``path``/``model`` and its
    drafter by ``drafter(model_folder, folder)`` at ``path``/``drafter_folder``;
    their folders, written, cached and replaced as ``make_tiny_vlm`` does
    (``generator`` and ``damping`` in their markers)."""
    marker = {
        "format": FORMAT,
        "generator": generator,
        "source": _marker_of(source),
        "damping": damping,
    }
    root = pathlib.Path(path)
    written = write_folder(
        root / "model",
        lambda sizes: {**marker, "files": sizes},
        model,
        overwrite=overwrite,
    )
    return written, write_folder(
        root / drafter_folder,
        lambda sizes: {**marker, "files": sizes},
        lambda folder: drafter(written, folder),
        overwrite=overwrite,
    )


def source_of(source: str | os.PathLike[str], *families: str) -> pathlib.Path:
    """``source`` as a path.

    Raises:
        ValueError: Its model is of none of ``families``.
    """
    folder = pathlib.Path(source)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") not in families:
        raise ValueError(f"{folder} is not a {' or '.join(families)} model")
    return folder


def make_tiny_assistant(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str],
    *,
    damping: float = 0.05,
    overwrite: bool = False,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``source`` (a Gemma 4 folder, such as ``tiny_omni_path()``)
    damped at ``path``/``model`` and a one-layer Gemma 4 assistant that
    agrees with it at ``path``/``assistant``; their folders. Written,
    cached and replaced as ``make_tiny_vlm`` does.

    Raises:
        ValueError: ``source`` is not a Gemma 4 model.
    """
    folder = source_of(source, "gemma4")
    return write_pair(
        path,
        folder,
        "mlx_pinned.testing.make_tiny_assistant",
        damping,
        lambda model: _write_damped(folder, model, damping),
        lambda _, assistant: _write_assistant(folder, assistant),
        overwrite=overwrite,
        drafter_folder="assistant",
    )


def _write_damped(source: pathlib.Path, folder: pathlib.Path, damping: float) -> None:
    import numpy as np

    _copy_files(source, folder)
    weights = _load(source / _WEIGHTS)
    for name in list(weights):
        # Gemma 4 normalizes each output before the residual: its norm scales.
        if name.startswith(_PREFIX + "model.layers.") and name.endswith(_GEMMA_OUTPUTS):
            weights[name] = weights[name] * np.float32(damping)
    _save(folder / _WEIGHTS, weights)


def _write_assistant(source: pathlib.Path, folder: pathlib.Path) -> None:
    import numpy as np

    from ._weights import parameter_specs

    text = json.loads((source / "config.json").read_text())["text_config"]
    hidden = int(text["hidden_size"])
    kind = text["layer_types"][-1]
    text = {
        **text,
        "num_hidden_layers": 1,
        "layer_types": [kind],
        "num_kv_shared_layers": 1,
    }
    config = {
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": hidden,
        "tie_word_embeddings": True,
        "use_ordered_embeddings": False,
        "block_size": 4,
        "text_config": text,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    module = "mlx_vlm.speculative.drafters.gemma4_assistant"
    specs = parameter_specs(
        module,
        lambda found: found.Model(found.ModelConfig.from_dict(config)),
        kind=f"assistant-{hidden}-{kind}",
    )
    embed = _load(source / _WEIGHTS)[_PREFIX + "model.embed_tokens.weight"]
    weights: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for name, shape in specs:
        if name == "model.embed_tokens.weight":
            value = embed  # its LM head, tied: the model's
        elif name == "pre_projection.weight":
            value = np.zeros(shape, dtype=np.float32)
            value[:, :hidden] = np.eye(hidden, dtype=np.float32)  # the token
        elif name.endswith(_GEMMA_OUTPUTS):
            value = np.zeros(shape, dtype=np.float32)
        elif len(shape) > 1:
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
        else:
            value = np.ones(shape, dtype=np.float32)
        weights[name] = value
    _save(folder / _WEIGHTS, weights)


def _copy_files(source: pathlib.Path, folder: pathlib.Path) -> None:
    for item in source.iterdir():
        if item.is_file() and item.name not in (_WEIGHTS, "mlx_pinned_tiny_vlm.json"):
            shutil.copy(item, folder / item.name)


def _marker_of(source: pathlib.Path) -> Any:
    try:
        return json.loads((source / "mlx_pinned_tiny_vlm.json").read_text())
    except OSError:
        return str(source)


def _write_mtp(
    source: pathlib.Path, folder: pathlib.Path, damping: float, seed: int
) -> None:
    import numpy as np

    _copy_files(source, folder)
    config = json.loads((source / "config.json").read_text())
    text = config["text_config"]
    text["mtp_num_hidden_layers"] = 1
    text["tie_word_embeddings"] = config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    weights = _load(source / _WEIGHTS)
    embed = weights[_PREFIX + "model.embed_tokens.weight"]
    weights[_PREFIX + "lm_head.weight"] = _cycle_head(embed, seed)
    for name in list(weights):
        if name.startswith(_PREFIX + "model.layers.") and name.endswith(_OUTPUTS):
            weights[name] = weights[name] * np.float32(damping)
    hidden = embed.shape[1]
    # One full-attention layer of the model's own shapes, its outputs zero.
    full = int(text["full_attention_interval"]) - 1
    layer = f"{_PREFIX}model.layers.{full}."
    for name in [n for n in weights if n.startswith(layer)]:
        value = weights[name]
        if name.endswith(_OUTPUTS):
            value = np.zeros_like(value)
        weights["mtp.layers.0." + name[len(layer) :]] = value
    fc = np.zeros((hidden, 2 * hidden), dtype=np.float32)
    fc[:, :hidden] = np.eye(hidden, dtype=np.float32)  # the token's embedding
    weights["mtp.fc.weight"] = fc
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = np.ones(hidden, dtype=np.float32)
    _save(folder / _WEIGHTS, weights)


def _cycle_head(embed: Any, seed: int) -> Any:
    """An LM head whose row for token ``next(x)`` is ``x``'s embedding, over
    one cycle through the tokens with a non-zero embedding (zero rows, the
    tokens never to be picked, stay zero)."""
    import numpy as np

    live = np.flatnonzero(embed.any(axis=1))
    order = np.random.default_rng(seed).permutation(live)
    head = np.zeros_like(embed)
    head[np.roll(order, -1)] = embed[order]
    return head


def _load(file: pathlib.Path) -> dict[str, Any]:
    from safetensors.numpy import load_file

    return dict(load_file(str(file)))


def _save(file: pathlib.Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    # Arrays made from host memory are already evaluated: no stream is bound.
    arrays = {name: mx.array(value) for name, value in weights.items()}
    mx.save_safetensors(str(file), arrays, metadata={"format": "mlx"})
