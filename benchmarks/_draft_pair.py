"""A served model and a draft model that agrees with it, both random, for
benchmarks/speculative.py's draft-model runs (written here, offline).

The served model is a Qwen3 (at the tiny size, a wider, deeper one than the
tiny model, with its tokenizer; at the bench size, the bench model's shape,
tokenizer and type) whose layers after the first have their output
projections scaled by ``damping``: the first layer carries most of the
answer, so a draft of the first layer alone (the same embeddings, the same
first layer) agrees with it on most tokens, as a small model distilled from
a large one does. ``damping`` sets how often (1.0: the draft is an
unrelated-looking model; 0.1: acceptance near 0.75 at two draft tokens at
the tiny size). Nothing here is a real model: it measures what a step costs
at a given acceptance, not what a real draft would accept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# At the tiny size: 8 layers of 256 values, heads of 32.
TINY_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_hidden_layers": 8,
}


def write_pair(
    folder: Path, *, size: str = "tiny", damping: float = 0.1
) -> tuple[Path, Path]:
    """Write the served model and its one-layer draft under ``folder``, from
    mlx_pinned.testing's Qwen3 of ``size``; their folders."""
    import mlx.core as mx
    import numpy as np

    from mlx_pinned.testing import bench_lm_path, tiny_lm_path

    base = bench_lm_path() if size == "bench" else tiny_lm_path()
    config = json.loads((base / "config.json").read_text())
    if size == "tiny":
        config.update(TINY_SHAPE)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, head = config["num_attention_heads"], config["head_dim"]
    inner = config["intermediate_size"]
    dtype = getattr(mx, config.get("dtype", "float32"))
    embed = "language_model.model.embed_tokens.weight"
    small = mx.load(str(base / "model.safetensors"))[embed].astype(mx.float32)
    # The model's zero rows (special tokens, lone high bytes) stay zero.
    zero = np.flatnonzero(~np.array(small).any(axis=1))
    rng = np.random.default_rng(0)

    def matrix(rows: int, columns: int, scale: float = 1.0) -> np.ndarray:
        value = rng.standard_normal((rows, columns), dtype=np.float32)
        return np.asarray(value * scale / np.sqrt(columns), dtype=np.float32)

    prefix = "language_model.model."
    embeddings = matrix(config["vocab_size"], hidden)
    embeddings[zero] = 0.0
    weights = {embed: embeddings, prefix + "norm.weight": np.ones(hidden, np.float32)}
    kv = config["num_key_value_heads"] * head
    for i in range(layers):
        scale = 1.0 if i == 0 else damping
        layer = f"{prefix}layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{layer}{norm}.weight"] = np.ones(hidden, np.float32)
        for norm in ("q_norm", "k_norm"):
            weights[f"{layer}self_attn.{norm}.weight"] = np.ones(head, np.float32)
        weights[layer + "self_attn.q_proj.weight"] = matrix(heads * head, hidden)
        weights[layer + "self_attn.k_proj.weight"] = matrix(kv, hidden)
        weights[layer + "self_attn.v_proj.weight"] = matrix(kv, hidden)
        weights[layer + "self_attn.o_proj.weight"] = matrix(hidden, heads * head, scale)
        weights[layer + "mlp.gate_proj.weight"] = matrix(inner, hidden)
        weights[layer + "mlp.up_proj.weight"] = matrix(inner, hidden)
        weights[layer + "mlp.down_proj.weight"] = matrix(hidden, inner, scale)
    served, draft = folder / "served", folder / "draft"
    for target, count in ((served, layers), (draft, 1)):
        target.mkdir(parents=True, exist_ok=True)
        for file in (
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ):
            shutil.copy(base / file, target / file)
        own = dict(config, num_hidden_layers=count)
        (target / "config.json").write_text(json.dumps(own, indent=2))
        kept = {
            name: mx.array(value, dtype=dtype)
            for name, value in weights.items()
            if ".layers." not in name
            or int(name.split(".layers.")[1].split(".")[0]) < count
        }
        mx.save_safetensors(
            str(target / "model.safetensors"), kept, metadata={"format": "mlx"}
        )
    return served, draft
