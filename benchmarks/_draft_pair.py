"""A served model and a draft model that agrees with it, both random, for
benchmarks/speculative.py's draft-model runs (written here, offline).

The served model is a wider, deeper Qwen3 than the tiny one (``layers`` of
``hidden`` values, the tiny model's tokenizer) whose layers after the first
have their output projections scaled by ``damping``: the first layer
carries most of the answer, so a draft of the first layer alone (the same
embeddings, the same first layer) agrees with it on most tokens, as a small
model distilled from a large one does. ``damping`` sets how often (1.0: the
draft is an unrelated-looking model; 0.1: acceptance near 0.75 at two draft
tokens on this machine). Nothing here is a real model: it measures what a
step costs at a given acceptance, not what a real draft would accept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HEAD = 32


def write_pair(
    folder: Path, *, layers: int = 8, hidden: int = 256, damping: float = 0.1
) -> tuple[Path, Path]:
    """Write the served model and its one-layer draft under ``folder``;
    their folders."""
    import mlx.core as mx
    import numpy as np

    from mlx_pinned.testing import tiny_lm_path

    tiny = tiny_lm_path()
    heads = hidden // HEAD
    config = json.loads((tiny / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=HEAD,
        num_hidden_layers=layers,
    )
    embed = "language_model.model.embed_tokens.weight"
    small = mx.load(str(tiny / "model.safetensors"))[embed]
    # The tiny model's zero rows (special tokens, lone high bytes) stay zero.
    zero = np.flatnonzero(~np.array(small).any(axis=1))
    rng = np.random.default_rng(0)

    def matrix(rows: int, columns: int, scale: float = 1.0) -> np.ndarray:
        value = rng.standard_normal((rows, columns), dtype=np.float32)
        return np.asarray(value * scale / np.sqrt(columns), dtype=np.float32)

    prefix = "language_model.model."
    embeddings = matrix(config["vocab_size"], hidden)
    embeddings[zero] = 0.0
    weights = {embed: embeddings, prefix + "norm.weight": np.ones(hidden, np.float32)}
    kv = config["num_key_value_heads"] * HEAD
    for i in range(layers):
        scale = 1.0 if i == 0 else damping
        layer = f"{prefix}layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{layer}{norm}.weight"] = np.ones(hidden, np.float32)
        for norm in ("q_norm", "k_norm"):
            weights[f"{layer}self_attn.{norm}.weight"] = np.ones(HEAD, np.float32)
        weights[layer + "self_attn.q_proj.weight"] = matrix(heads * HEAD, hidden)
        weights[layer + "self_attn.k_proj.weight"] = matrix(kv, hidden)
        weights[layer + "self_attn.v_proj.weight"] = matrix(kv, hidden)
        weights[layer + "self_attn.o_proj.weight"] = matrix(hidden, heads * HEAD, scale)
        weights[layer + "mlp.gate_proj.weight"] = matrix(3 * hidden, hidden)
        weights[layer + "mlp.up_proj.weight"] = matrix(3 * hidden, hidden)
        weights[layer + "mlp.down_proj.weight"] = matrix(hidden, 3 * hidden, scale)
    served, draft = folder / "served", folder / "draft"
    for target, count in ((served, layers), (draft, 1)):
        target.mkdir(parents=True, exist_ok=True)
        for file in (
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ):
            shutil.copy(tiny / file, target / file)
        own = dict(config, num_hidden_layers=count)
        (target / "config.json").write_text(json.dumps(own, indent=2))
        kept = {
            name: mx.array(value)
            for name, value in weights.items()
            if ".layers." not in name
            or int(name.split(".layers.")[1].split(".")[0]) < count
        }
        mx.save_safetensors(
            str(target / "model.safetensors"), kept, metadata={"format": "mlx"}
        )
    return served, draft
