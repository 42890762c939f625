"""Parakeet, as a speech-to-text model that mlx-audio's loader loads: its
own CTC model class (NVIDIA NeMo's ``EncDecCTCModelBPE`` layout) with
random weights. Calling thread.

NeMo's config carries the vocabulary (SentencePiece pieces, ``▁`` for a
word's start) in the decoder's section, so there is no tokenizer file. The
audio is 80 log-mel features every 10 ms, subsampled 8 times by the
Conformer encoder: a token every 80 ms at most, greedy CTC (English only).
"""

from __future__ import annotations

import functools
from typing import Any, Final

from ._family import SpeechFamily

#: The pieces: a few words, then letters alone and as a word's start.
_LETTERS: Final = "abcdefghijklmnopqrstuvwxyz"
VOCABULARY: Final = (
    "▁the",
    "▁a",
    "▁cat",
    "▁on",
    "▁table",
    "▁is",
    "ing",
    "s",
    ".",
    *(f"▁{letter}" for letter in _LETTERS),
    *_LETTERS,
)


@functools.cache
def _config() -> dict[str, Any]:
    return {
        "target": "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE",
        "model_type": "parakeet",
        "preprocessor": {
            "sample_rate": 16000,
            "normalize": "per_feature",
            "window_size": 0.025,
            "window_stride": 0.01,
            "window": "hann",
            "features": 80,
            "n_fft": 512,
            "dither": 0.0,  # no noise: the same file, the same features
        },
        "encoder": {
            "feat_in": 80,
            "n_layers": 1,
            "d_model": 32,
            "n_heads": 2,
            "ff_expansion_factor": 2,
            "subsampling_factor": 8,
            "self_attention_model": "rel_pos",
            "subsampling": "dw_striding",
            "conv_kernel_size": 9,
            "subsampling_conv_channels": 32,
            "pos_emb_max_len": 5000,
        },
        "decoder": {
            "feat_in": 32,
            "num_classes": len(VOCABULARY),
            "vocabulary": list(VOCABULARY),
        },
        "decoding": {"greedy": {}},
    }


def _build(module: Any, config: dict[str, Any]) -> Any:
    return module.Model.from_config(config)


PARAKEET: Final = SpeechFamily(
    "parakeet",
    (),
    _config,
    dict,
    build=_build,
    vision=False,
    tokenizer=lambda _: b"",
    generator="make_tiny_transcription",
    module="mlx_audio.stt.models.parakeet.parakeet",
)
