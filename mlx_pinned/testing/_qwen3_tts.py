"""Qwen3-TTS (CustomVoice), as a text-to-speech model that mlx-audio's own
loader (``mlx_audio.tts.utils.load_model``) loads offline: the talker and
its code predictor in ``model.safetensors``, the speech tokenizer's decoder
(the vocoder) in ``speech_tokenizer/``, a byte-level BPE text tokenizer and
a greedy generation config. Calling thread.

The vocoder keeps Qwen3-TTS's 12.5 frames a second and 1920 samples a
frame (24 kHz), with every upsampling stage in its ConvNeXt blocks and none
in the convolution blocks: mlx-audio's loader guesses each convolution's
weight layout from its shape, and the convolution blocks of a model this
small have shapes it guesses wrong (it transposes them).
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Final

from ._family import Family
from ._install import to_json
from ._tokenizer import VOCAB_SIZE, ids, tokenizer_config
from ._weights import parameter_specs, write_weights

__all__ = ["QWEN3_TTS", "VOICES"]

#: The text tokenizer's special tokens, in id order.
SPECIAL_TOKENS: Final = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)

_IDS: Final = ids(SPECIAL_TOKENS)

#: Codes in each codebook; the talker's own tokens come after them.
CODEBOOK_SIZE: Final = 32

#: Codebooks a frame is made of (the first from the talker, the rest from
#: its code predictor).
CODE_GROUPS: Final = 4

#: Its voices (Qwen3-TTS CustomVoice's speakers), each a talker token.
VOICES: Final = ("ryan", "serena", "vivian")

# The talker's vocabulary is its codes, then 1024 tokens of its own (mlx-audio
# masks all of those but the end of speech at every step).
_CODEC: Final = {
    "codec_pad_id": CODEBOOK_SIZE + 4,
    "codec_bos_id": CODEBOOK_SIZE + 5,
    "codec_eos_token_id": CODEBOOK_SIZE + 6,
    "codec_think_id": CODEBOOK_SIZE + 10,
    "codec_nothink_id": CODEBOOK_SIZE + 11,
    "codec_think_bos_id": CODEBOOK_SIZE + 12,
    "codec_think_eos_id": CODEBOOK_SIZE + 13,
}

_SMALL: Final = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_code_groups": CODE_GROUPS,
}


@functools.cache
def _config() -> dict[str, Any]:
    talker = {
        **_SMALL,
        "vocab_size": CODEBOOK_SIZE + 1024,
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": [4, 2, 2],
            "rope_type": "default",
        },
        "text_hidden_size": 32,
        "text_vocab_size": VOCAB_SIZE,
        **_CODEC,
        "codec_language_id": {
            "english": CODEBOOK_SIZE + 20,
            "chinese": CODEBOOK_SIZE + 21,
        },
        "spk_id": {voice: CODEBOOK_SIZE + 40 + n for n, voice in enumerate(VOICES)},
        "spk_is_dialect": dict.fromkeys(VOICES, False),
        "code_predictor_config": {**_SMALL, "vocab_size": CODEBOOK_SIZE},
    }
    return {
        "model_type": "qwen3_tts",
        "tts_model_type": "custom_voice",
        # Not the small checkpoint's "0b6", which ignores instructions.
        "tts_model_size": "1b7",
        "talker_config": talker,
        "im_start_token_id": _IDS["<|im_start|>"],
        "im_end_token_id": _IDS["<|im_end|>"],
        "tts_pad_token_id": _IDS["<|tts_pad|>"],
        "tts_bos_token_id": _IDS["<|tts_bos|>"],
        "tts_eos_token_id": _IDS["<|tts_eos|>"],
        "sample_rate": 24000,
    }


@functools.cache
def _vocoder_config() -> dict[str, Any]:
    decoder = {
        "latent_dim": 16,
        # Its projections' inputs are half of it: over 64, so their kernel-1
        # weights are read the right way round (see the module docstring).
        "codebook_dim": 160,
        "codebook_size": CODEBOOK_SIZE,
        "decoder_dim": 16,
        "hidden_size": 16,
        "intermediate_size": 32,
        "head_dim": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "num_quantizers": CODE_GROUPS,
        "num_semantic_quantizers": 1,
        "upsample_rates": [],
        "upsampling_ratios": [2, 2, 2, 2, 2, 2, 2, 3, 5],  # 1920 samples a frame
    }
    return {
        "decoder_config": decoder,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
    }


def _files() -> dict[str, Any]:
    return {
        "tokenizer_config.json": tokenizer_config(
            SPECIAL_TOKENS, "", bos=None, eos="<|im_end|>", pad="<|endoftext|>"
        ),
        # Greedy, so the same text and voice always make the same audio.
        "generation_config.json": {
            "temperature": 0.0,
            "top_k": 0,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "max_new_tokens": 8192,
        },
        "speech_tokenizer/config.json": _vocoder_config(),
    }


def _build_talker(module: Any) -> Any:
    return module.Model(module.ModelConfig.from_dict(_config()))


def _build_vocoder(module: Any) -> Any:
    from mlx_audio.tts.models.qwen3_tts.config import Qwen3TTSTokenizerConfig

    config = dict(_vocoder_config())
    return module.Qwen3TTSSpeechTokenizer(Qwen3TTSTokenizerConfig(**config))


@dataclass(frozen=True)
class _Qwen3TTS(Family):
    """A family of mlx-audio's text-to-speech models: its talker in
    ``model.safetensors``, its vocoder in ``speech_tokenizer/``."""

    def marker(self, seed: int, sizes: dict[str, int]) -> dict[str, Any]:
        # mlx-audio's version too: its classes give the shapes.
        return {**super().marker(seed, sizes), "mlx_audio": _version("mlx-audio")}

    def write(self, folder: pathlib.Path, seed: int) -> None:
        (folder / "speech_tokenizer").mkdir()
        files = {"config.json": self.config(), **self.files()}
        for name, value in files.items():
            (folder / name).write_bytes(to_json(value))
        (folder / "tokenizer.json").write_bytes(self.tokenizer(self.specials))
        # The end of speech gets a zero logit, below the best random code's:
        # greedy decoding never picks it, and speaks until its frame limit.
        eos = _CODEC["codec_eos_token_id"]
        write_weights(
            folder / "model.safetensors",
            seed,
            parameter_specs(
                "mlx_audio.tts.models.qwen3_tts", _build_talker, kind="talker"
            ),
            {"talker.codec_head.weight": [eos]},
        )
        write_weights(
            folder / "speech_tokenizer" / "model.safetensors",
            seed + 1,
            parameter_specs(
                "mlx_audio.tts.models.qwen3_tts.speech_tokenizer",
                _build_vocoder,
                kind="vocoder",
            ),
            {},
        )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


QWEN3_TTS: Final = _Qwen3TTS(
    "qwen3_tts",
    SPECIAL_TOKENS,
    _config,
    _files,
    vision=False,
    generator="make_tiny_speech",
)
