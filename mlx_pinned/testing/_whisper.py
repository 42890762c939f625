"""Whisper, as a speech-to-text model that mlx-audio's loader
(``mlx_audio.stt.utils.load_model``) loads: its own model class with random
weights, a multilingual vocabulary laid out as Whisper's is, and the
processor files that ``transformers``' ``WhisperProcessor`` reads. Calling
thread.

Whisper's decoding code reads its vocabulary's layout: every text token
below the end-of-text token, then the special tokens (the 99 languages and
the tasks among them), then the 1,501 timestamps ``<|0.00|>`` to
``<|30.00|>`` last. A vocabulary of 51,865 or more is what makes a model
multilingual (a language token and a task token in every prompt). The tiny
byte-level BPE vocabulary is padded to that size with tokens no text
encodes to.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Final

from ._family import SpeechFamily
from ._tokenizer import VOCAB_SIZE, high_byte_ids, tokenizer_json

#: The smallest multilingual Whisper vocabulary (large-v2's).
N_VOCAB: Final = 51865
#: Timestamps, every 20 ms of a 30-second window.
TIMESTAMPS: Final = 1501
#: The languages of a 51,865-token vocabulary, in Whisper's order.
LANGUAGE_COUNT: Final = 99

#: The model's longest decoder input, in tokens (half of it is the most a
#: window's answer may take).
TEXT_CONTEXT: Final = 64

_TASKS: Final = (
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
)
_EMBEDDING: Final = "decoder.token_embedding.weight"
# Whisper's head is tied to its embedding, and its final norm's output sums
# to zero over its features before the norm's bias is added. So with a
# constant bias, a constant row gets the same logit whatever the input: the
# rows no answer may hold (the unused tokens, the special ones, the
# timestamps, the lone high bytes) are made such rows, far below every text
# token's, even when sampled at temperature 1 (Whisper's fallback). A
# wider norm scale gives the text tokens logits wide enough that greedy
# decoding does not find the same token everywhere.
_LOGIT_SCALE: Final = 4.0
_POSITION_SCALE: Final = 4.0
_HIDDEN_ROW: Final = -10.0
_NORM_BIAS: Final = 0.1


@functools.cache
def _specials() -> tuple[str, ...]:
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    languages = [f"<|{code}|>" for code in list(LANGUAGES)[:LANGUAGE_COUNT]]
    return ("<|endoftext|>", "<|startoftranscript|>", *languages, *_TASKS)


def _timestamps() -> list[str]:
    return [f"<|{index * 0.02:.2f}|>" for index in range(TIMESTAMPS)]


def _first_special() -> int:
    return N_VOCAB - TIMESTAMPS - len(_specials())


def special_index(token: str) -> int:
    """Where ``token`` is among the special tokens."""
    return _specials().index(token)


@functools.cache
def _config() -> dict[str, Any]:
    return {
        "model_type": "whisper",
        "n_mels": 80,
        "n_audio_ctx": 1500,
        "n_audio_state": 32,
        "n_audio_head": 2,
        "n_audio_layer": 1,
        "n_vocab": N_VOCAB,
        "n_text_ctx": TEXT_CONTEXT,
        "n_text_state": 32,
        "n_text_head": 2,
        "n_text_layer": 2,
    }


def _tokenizer(specials: tuple[str, ...]) -> bytes:
    """The byte-level BPE tokenizer (no special tokens of its own: its text
    tokens take ids 0-383), padded with unused tokens, then Whisper's
    special tokens and its timestamps as added tokens."""
    data = json.loads(tokenizer_json(()))
    vocab: dict[str, int] = data["model"]["vocab"]
    first = _first_special()
    vocab.update({f"<|unused{n}|>": n for n in range(VOCAB_SIZE, first)})
    tokens = [*((token, True) for token in specials)]
    tokens += [(token, False) for token in _timestamps()]
    data["added_tokens"] = [
        {
            "id": first + index,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for index, (token, special) in enumerate(tokens)
    ]
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


def _files() -> dict[str, Any]:
    first = _first_special()
    added = json.loads(_tokenizer(_specials()))["added_tokens"]
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    text = "<|endoftext|>"
    return {
        "tokenizer_config.json": {
            "tokenizer_class": "WhisperTokenizer",
            "bos_token": text,
            "eos_token": text,
            "unk_token": text,
            "pad_token": text,
            "model_max_length": 1024,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "added_tokens_decoder": {
                str(token["id"]): {key: token[key] for key in fields} for token in added
            },
        },
        "preprocessor_config.json": {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "processor_class": "WhisperProcessor",
            "feature_size": 80,
            "sampling_rate": 16000,
            "hop_length": 160,
            "chunk_length": 30,
            "n_fft": 400,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": False,
        },
        "generation_config.json": {
            "decoder_start_token_id": first + 1,
            "eos_token_id": first,
            "pad_token_id": first,
            "no_timestamps_token_id": first + len(_specials()) - 1,
            "is_multilingual": True,
        },
    }


def _build(module: Any, config: dict[str, Any]) -> Any:
    return module.Model(module.ModelDimensions.from_dict(config))


@functools.cache
def _hidden() -> list[int]:
    """The rows no answer may hold. The two task tokens keep random rows,
    so a translation differs from a transcription (decoding never picks
    either: Whisper's suppresses them)."""
    first = _first_special()
    tasks = {first + special_index(token) for token in _TASKS[:2]}
    return [
        *high_byte_ids(()),
        *(n for n in range(VOCAB_SIZE, N_VOCAB) if n not in tasks),
    ]


def _adjust(name: str, value: Any) -> Any:
    if name == _EMBEDDING:
        value[_hidden()] = _HIDDEN_ROW
    elif name == "decoder.ln.weight":
        value *= _LOGIT_SCALE
    elif name == "decoder.ln.bias":
        value += _NORM_BIAS
    elif name == "decoder.positional_embedding":
        value *= _POSITION_SCALE
    return value


WHISPER: Final = SpeechFamily(
    "whisper",
    (),
    _config,
    _files,
    build=_build,
    vision=False,
    tokenizer=lambda _: _tokenizer(_specials()),
    generator="make_tiny_transcription",
    module="mlx_audio.stt.models.whisper.whisper",
    adjust=_adjust,
)
