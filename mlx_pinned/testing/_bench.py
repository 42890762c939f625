"""The writers of the bench models: the tiny families at a small real
model's proportions, for the benchmarks. Runs on the calling thread.
"""

from __future__ import annotations

import os
import pathlib
from typing import Final

from ._configs import BENCH
from ._gemma import GEMMA3
from ._gemma4 import GEMMA4
from ._qwen import QWEN3, QWEN3_VL
from ._qwen3_5 import QWEN3_5
from ._tiny import family_of, make

__all__ = ["BENCH_LM_TYPES", "BENCH_MODEL_TYPES", "make_bench_lm", "make_bench_vlm"]

_VISION: Final = {
    family.model_type: family.at(BENCH)
    for family in (QWEN3_VL, QWEN3_5, GEMMA3, GEMMA4)
}
_TEXT: Final = {family.model_type: family.at(BENCH) for family in (QWEN3,)}

#: The vision families :func:`make_bench_vlm` writes (``qwen3_vl`` first).
BENCH_MODEL_TYPES: Final = tuple(_VISION)
#: The text-only families :func:`make_bench_lm` writes (``qwen3``).
BENCH_LM_TYPES: Final = tuple(_TEXT)


def make_bench_vlm(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    overwrite: bool = False,
    model_type: str = "qwen3_vl",
) -> pathlib.Path:
    """Write a random-weight vision-language model with a small real model's
    proportions, which mlx-vlm loads offline: a benchmark's model, where
    compute, not Python, fills a decode step.

    The family's tiny model (:func:`make_tiny_vlm`, :func:`make_tiny_omni`)
    at another size, in bfloat16: a 6-layer, 512-wide decoder (8 query
    heads of 64, 4 KV heads, a 1536-wide MLP), a 4-layer, 256-wide vision
    tower, and 32,768 tokens: the tiny tokenizer, its special tokens and
    chat template, padded with generated words that no text encodes to but
    the model may pick, so that the LM head and sampling cost what they do
    on a real model. About 36M parameters in the decoder (17M of them the
    tied embeddings), 4-7M in the tower, 80-110 MB on disk. Each family
    keeps its own layout: ``qwen3_5`` has one full-attention layer (the
    fourth) among gated delta-net ones; ``gemma3`` and ``gemma4`` slide a
    512-token window in every layer but the last. Images become as many
    tokens as in the tiny model.

    Written, cached and replaced as :func:`make_tiny_vlm` does, with its
    arguments and errors; a call that writes takes a second or two.
    ``model_type`` is one of :data:`BENCH_MODEL_TYPES`.
    """
    family = family_of(_VISION, model_type, "make_bench_vlm")
    return make(family, path, seed, overwrite)


def make_bench_lm(
    path: str | os.PathLike[str],
    model_type: str = "qwen3",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write :func:`make_bench_vlm`'s decoder as a text-only model.

    ``model_type`` is one of :data:`BENCH_LM_TYPES`; written, cached and
    replaced as :func:`make_tiny_vlm` does, with its arguments and errors.
    """
    family = family_of(_TEXT, model_type, "make_bench_lm")
    return make(family, path, seed, overwrite)
