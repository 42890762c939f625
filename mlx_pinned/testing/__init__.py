"""Tiny random-weight models of real mlx-vlm families, bench models of some
at a small real model's proportions, and small test images.

Everything here works offline: a model folder is written from mlx-vlm's own
model class of its family, a byte-level BPE tokenizer trained on a few
embedded sentences and hand-written processor configs, so
``mlx_vlm.load(str(path))`` never reaches the Hugging Face hub.

Example::

    import mlx_vlm
    from mlx_pinned.testing import tiny_vlm_path

    model, processor = mlx_vlm.load(str(tiny_vlm_path()))

Each kind has a writer, its families and a shared copy in the cache:
:func:`make_tiny_vlm`, :data:`TINY_MODEL_TYPES`, :func:`tiny_vlm_path` for
vision chat; :func:`make_tiny_lm`, :data:`TINY_LM_TYPES` (and
:data:`TINY_TOOL_LM_TYPES`), :func:`tiny_lm_path` for text chat; and
``make_tiny_<kind>``, ``TINY_<KIND>_TYPES``, ``tiny_<kind>_path`` for
``embedding``, ``reranker``, ``transcription``, ``speech`` and ``omni``
(chat that hears audio too). The benchmarks' models are
:func:`make_bench_vlm`, :data:`BENCH_MODEL_TYPES`, :func:`bench_vlm_path`
and :func:`make_bench_lm`, :data:`BENCH_LM_TYPES`, :func:`bench_lm_path`:
the tiny models' families at a size where compute, not Python, fills a
decode step. :func:`make_tiny_mtp`, :func:`make_tiny_assistant`,
:func:`make_tiny_dflash` and :func:`make_tiny_eagle3` write models with a
native drafter that agrees with them (:func:`tiny_mtp_path`,
:func:`tiny_assistant_paths`, :func:`tiny_dflash_paths`,
:func:`tiny_eagle3_paths`). Everything runs on the calling thread, from
any thread or process at once. ``import mlx_pinned.testing`` is cheap: MLX,
mlx-vlm, ``tokenizers`` and Pillow are imported inside the functions.
"""

from __future__ import annotations

import os
import pathlib

from ._bench import BENCH_LM_TYPES, BENCH_MODEL_TYPES, make_bench_lm, make_bench_vlm
from ._dflash import make_tiny_dflash
from ._drafters import make_tiny_assistant, make_tiny_mtp
from ._eagle3 import make_tiny_eagle3
from ._images import image_data_uri, make_test_image
from ._qwen import _CHAT_TEMPLATE as _CHAT_TEMPLATE
from ._qwen import SPECIAL_TOKENS
from ._tiny import (
    TINY_EMBEDDING_TYPES,
    TINY_LM_TYPES,
    TINY_MODEL_TYPES,
    TINY_OMNI_TYPES,
    TINY_RERANKER_TYPES,
    TINY_SPEECH_TYPES,
    TINY_TOOL_LM_TYPES,
    TINY_TRANSCRIPTION_TYPES,
    make_tiny_embedding,
    make_tiny_lm,
    make_tiny_omni,
    make_tiny_reranker,
    make_tiny_speech,
    make_tiny_transcription,
    make_tiny_vlm,
)

__all__ = [
    "BENCH_LM_TYPES",
    "BENCH_MODEL_TYPES",
    "SPECIAL_TOKENS",
    "TINY_EMBEDDING_TYPES",
    "TINY_LM_TYPES",
    "TINY_MODEL_TYPES",
    "TINY_OMNI_TYPES",
    "TINY_RERANKER_TYPES",
    "TINY_SPEECH_TYPES",
    "TINY_TOOL_LM_TYPES",
    "TINY_TRANSCRIPTION_TYPES",
    "bench_lm_path",
    "bench_vlm_path",
    "image_data_uri",
    "make_bench_lm",
    "make_bench_vlm",
    "make_test_image",
    "make_tiny_assistant",
    "make_tiny_dflash",
    "make_tiny_eagle3",
    "make_tiny_embedding",
    "make_tiny_lm",
    "make_tiny_mtp",
    "make_tiny_omni",
    "make_tiny_reranker",
    "make_tiny_speech",
    "make_tiny_transcription",
    "make_tiny_vlm",
    "tiny_assistant_paths",
    "tiny_dflash_paths",
    "tiny_eagle3_paths",
    "tiny_embedding_path",
    "tiny_lm_path",
    "tiny_mtp_path",
    "tiny_omni_path",
    "tiny_reranker_path",
    "tiny_speech_path",
    "tiny_transcription_path",
    "tiny_vlm_path",
]


def tiny_vlm_path(model_type: str = "qwen3_vl") -> pathlib.Path:
    """The shared tiny vision model of a family (seed 0), written on first use.

    The folder is ``tiny-vlm`` (``qwen3_vl``) or ``tiny-vlm-<model_type>``
    under ``$MLX_PINNED_CACHE``, else ``~/.cache/mlx-pinned``. It is rebuilt
    when the files this package writes or the installed mlx-vlm version
    change; when the model is already there a call only reads a small JSON
    file.
    """
    name = "tiny-vlm" if model_type == "qwen3_vl" else f"tiny-vlm-{model_type}"
    return make_tiny_vlm(_cache() / name, seed=0, model_type=model_type)


def tiny_lm_path(model_type: str = "qwen3") -> pathlib.Path:
    """As :func:`tiny_vlm_path`: ``tiny-lm-<model_type>``."""
    return make_tiny_lm(_cache() / f"tiny-lm-{model_type}", model_type, seed=0)


def tiny_embedding_path(model_type: str = "bert") -> pathlib.Path:
    """As :func:`tiny_vlm_path`: ``tiny-embedding-<model_type>``."""
    return make_tiny_embedding(
        _cache() / f"tiny-embedding-{model_type}", model_type, seed=0
    )


def tiny_reranker_path(model_type: str = "bert") -> pathlib.Path:
    """As :func:`tiny_vlm_path`: ``tiny-reranker-<model_type>``."""
    return make_tiny_reranker(
        _cache() / f"tiny-reranker-{model_type}", model_type, seed=0
    )


def tiny_transcription_path(model_type: str = "whisper") -> pathlib.Path:
    """As :func:`tiny_vlm_path`: ``tiny-transcription-<model_type>``."""
    return make_tiny_transcription(
        _cache() / f"tiny-transcription-{model_type}", model_type, seed=0
    )


def tiny_speech_path(model_type: str = "qwen3_tts") -> pathlib.Path:
    """As :func:`tiny_vlm_path`: ``tiny-speech-<model_type>``."""
    return make_tiny_speech(_cache() / f"tiny-speech-{model_type}", model_type, seed=0)


def tiny_omni_path(model_type: str = "gemma4") -> pathlib.Path:
    """As :func:`tiny_vlm_path`: ``tiny-omni-<model_type>``."""
    return make_tiny_omni(_cache() / f"tiny-omni-{model_type}", model_type, seed=0)


def bench_vlm_path(model_type: str = "qwen3_vl") -> pathlib.Path:
    """As :func:`tiny_vlm_path`, for :func:`make_bench_vlm`:
    ``bench-vlm-<model_type>``."""
    return make_bench_vlm(
        _cache() / f"bench-vlm-{model_type}", seed=0, model_type=model_type
    )


def bench_lm_path(model_type: str = "qwen3") -> pathlib.Path:
    """As :func:`tiny_vlm_path`, for :func:`make_bench_lm`:
    ``bench-lm-<model_type>``."""
    return make_bench_lm(_cache() / f"bench-lm-{model_type}", model_type, seed=0)


def tiny_mtp_path(damping: float = 0.05) -> pathlib.Path:
    """The tiny ``qwen3_5`` with MTP layers in its checkpoint that agree with
    it (:func:`make_tiny_mtp`): ``tiny-mtp-<damping>``."""
    return make_tiny_mtp(
        _cache() / f"tiny-mtp-{damping}", tiny_vlm_path("qwen3_5"), damping=damping
    )


def tiny_assistant_paths(damping: float = 0.05) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny ``gemma4`` (damped) and a Gemma 4 assistant that agrees with
    it (:func:`make_tiny_assistant`), under ``tiny-assistant-<damping>``."""
    return make_tiny_assistant(
        _cache() / f"tiny-assistant-{damping}", tiny_omni_path(), damping=damping
    )


def tiny_dflash_paths(damping: float = 0.05) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny ``qwen3_5`` (damped) and a DFlash drafter that agrees with it
    (:func:`make_tiny_dflash`), under ``tiny-dflash-<damping>``."""
    return make_tiny_dflash(
        _cache() / f"tiny-dflash-{damping}", tiny_vlm_path("qwen3_5"), damping=damping
    )


def tiny_eagle3_paths(damping: float = 0.05) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny ``qwen3_5`` (its layers twice, damped) and an EAGLE-3 drafter
    that agrees with it (:func:`make_tiny_eagle3`), under
    ``tiny-eagle3-<damping>``."""
    return make_tiny_eagle3(
        _cache() / f"tiny-eagle3-{damping}", tiny_vlm_path("qwen3_5"), damping=damping
    )


def _cache() -> pathlib.Path:
    root = os.environ.get("MLX_PINNED_CACHE")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "mlx-pinned"
