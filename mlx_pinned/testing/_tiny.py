"""The writers of the tiny models, one per kind, and the families each
writes. Runs on the calling thread.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Final

from ._aya import AYA_VISION
from ._bert import BERT, BERT_RERANKER
from ._family import Family
from ._gemma import GEMMA3
from ._gemma4 import GEMMA4
from ._install import write_folder
from ._llama import LLAMA
from ._mistral import MISTRAL3
from ._parakeet import PARAKEET
from ._qwen import QWEN2_5_VL, QWEN3, QWEN3_VL, QWEN3_VL_EMBEDDING
from ._qwen3_5 import QWEN3_5
from ._qwen3_tts import QWEN3_TTS
from ._smolvlm import SMOLVLM
from ._tool_families import TOOL_FAMILIES
from ._whisper import WHISPER

__all__ = [
    "TINY_EMBEDDING_TYPES",
    "TINY_LM_TYPES",
    "TINY_MODEL_TYPES",
    "TINY_OMNI_TYPES",
    "TINY_RERANKER_TYPES",
    "TINY_SPEECH_TYPES",
    "TINY_TOOL_LM_TYPES",
    "TINY_TRANSCRIPTION_TYPES",
    "make_tiny_embedding",
    "make_tiny_lm",
    "make_tiny_omni",
    "make_tiny_reranker",
    "make_tiny_speech",
    "make_tiny_transcription",
    "make_tiny_vlm",
]

_VISION: Final = {
    family.model_type: family
    for family in (
        QWEN3_VL,
        QWEN2_5_VL,
        QWEN3_5,
        GEMMA3,
        SMOLVLM,
        MISTRAL3,
        AYA_VISION,
    )
}
_TEXT: Final = {family.model_type: family for family in (QWEN3, LLAMA)}

#: The vision families :func:`make_tiny_vlm` writes (``qwen3_vl`` first).
TINY_MODEL_TYPES: Final = tuple(_VISION)
_TOOLS: Final = {family.key: family for family in TOOL_FAMILIES}

#: The text-only families :func:`make_tiny_lm` writes (``qwen3`` first).
TINY_LM_TYPES: Final = tuple(_TEXT)
#: The text-only families :func:`make_tiny_lm` writes with a real family's
#: tool-calling template and special tokens: ``llama3_tools`` (Llama 3.1's
#: JSON calls), ``mistral_tools`` (Mistral v3's ``[TOOL_CALLS]``),
#: ``gpt_oss_harmony`` (harmony) and ``qwen3_coder`` (its XML calls). The
#: first three are Llama decoders, the last a Qwen3 one.
TINY_TOOL_LM_TYPES: Final = tuple(_TOOLS)
_EMBEDDING: Final = {family.model_type: family for family in (BERT, QWEN3_VL_EMBEDDING)}
#: The embedding families :func:`make_tiny_embedding` writes (``bert``, then
#: ``qwen3_vl_embedding``, which embeds images too).
TINY_EMBEDDING_TYPES: Final = tuple(_EMBEDDING)
_RERANKER: Final = {family.model_type: family for family in (BERT_RERANKER,)}
#: The reranker families :func:`make_tiny_reranker` writes (``bert``).
TINY_RERANKER_TYPES: Final = tuple(_RERANKER)
_TRANSCRIPTION: Final = {family.model_type: family for family in (WHISPER, PARAKEET)}
#: The speech-to-text families :func:`make_tiny_transcription` writes
#: (``whisper`` first, then ``parakeet``).
TINY_TRANSCRIPTION_TYPES: Final = tuple(_TRANSCRIPTION)
_SPEECH: Final = {family.model_type: family for family in (QWEN3_TTS,)}
#: The text-to-speech families :func:`make_tiny_speech` writes
#: (``qwen3_tts``).
TINY_SPEECH_TYPES: Final = tuple(_SPEECH)
_OMNI: Final = {family.model_type: family for family in (GEMMA4,)}
#: The chat families that take audio :func:`make_tiny_omni` writes
#: (``gemma4``).
TINY_OMNI_TYPES: Final = tuple(_OMNI)


def make_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    overwrite: bool = False,
    model_type: str = "qwen3_vl",
) -> pathlib.Path:
    """Write a tiny random-weight vision-language model that mlx-vlm loads offline.

    The default, ``qwen3_vl``, has a 2-layer, 64-wide text model with tied
    embeddings and a 2-layer, 32-wide vision tower (patch 16, spatial merge
    2, one deepstack layer): about 215k float32 parameters, under 1 MB on
    disk. A 64x64 image becomes 4 image tokens. Every family has a decoder of
    the same size, its own vision tower, processor files, special tokens and
    chat template (docs/testing.md lists them). The special tokens have zero
    embeddings, so greedy decoding never picks one and always runs to
    ``max_tokens``; to test a stop, bias the end-of-turn token with
    ``logit_bias``.

    The files are written to a temporary folder beside ``path`` and renamed
    into place, so a folder that appears at ``path`` is always complete. Calls
    for the same or different paths may run at once from any threads or
    processes. A folder being replaced (``overwrite``, another seed or
    family, an older format) is renamed aside and deleted only after the new
    one is in place; a reader that opened the old folder before that may see
    it emptied.

    Runs on the calling thread, which need not be an MLX thread: it builds no
    lazy MLX array and gets no MLX stream. The first call per family in a
    process also imports mlx-vlm and builds its model class once, on a
    short-lived private thread, to learn the parameter names and shapes;
    after that a call takes tens of milliseconds. It blocks and cannot be
    cancelled part-way; if it raises, its temporary folder is removed.

    Args:
        path: The folder to write. Its parent is created if missing.
        seed: Seeds the weights. The same seed gives byte-identical files.
        overwrite: Replace whatever is at ``path``, even a complete model with
            the same seed.
        model_type: One of :data:`TINY_MODEL_TYPES`.

    Returns:
        ``path`` as a :class:`pathlib.Path`, holding the model.

    Raises:
        FileExistsError: ``path`` holds something that is not a model written
            by this package, and ``overwrite`` is false.
        ValueError: ``model_type`` is not one of :data:`TINY_MODEL_TYPES`.
    """
    family = family_of(_VISION, model_type, "make_tiny_vlm")
    return make(family, path, seed, overwrite)


def make_tiny_lm(
    path: str | os.PathLike[str],
    model_type: str = "qwen3",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write a tiny random-weight text-only model that mlx-vlm loads offline.

    mlx-vlm's own text family class (``qwen3`` or ``llama``): the same
    2-layer, 64-wide decoder as :func:`make_tiny_vlm`'s, with the family's
    tokenizer and chat template and no processor files, so mlx-vlm loads the
    tokenizer as the processor.

    ``model_type`` is one of :data:`TINY_LM_TYPES` or :data:`TINY_TOOL_LM_TYPES`;
    written, cached and replaced as :func:`make_tiny_vlm` does, with its arguments
    and errors.
    """
    family = family_of(_TEXT | _TOOLS, model_type, "make_tiny_lm")
    return make(family, path, seed, overwrite)


def make_tiny_embedding(
    path: str | os.PathLike[str],
    model_type: str = "bert",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write a tiny random-weight embedding model that mlx-vlm's embedding
    loader (``mlx_vlm.embedding_loader.load_embedding_model``) loads offline.

    ``bert``: mlx-vlm's own BERT class, 2 layers, 64 wide, 128 positions (its
    longest input), mean-pooled and normalised as the loader's model does,
    with the byte-level tokenizer wrapping every text in ``[CLS] ... [SEP]``.
    Its config lists ``matryoshka_dimensions`` (16, 32, 64), so a server may
    cut its vectors short. ``qwen3_vl_embedding``: mlx-vlm's Qwen3-VL-Embedding
    (images and text in one space), the tiny Qwen3-VL of :func:`make_tiny_vlm`
    with no LM head, its last token pooled and normalised, with the same
    processor and chat template.

    ``model_type`` is one of :data:`TINY_EMBEDDING_TYPES`; written, cached and
    replaced as :func:`make_tiny_vlm` does, with its arguments and errors.
    """
    family = family_of(_EMBEDDING, model_type, "make_tiny_embedding")
    return make(family, path, seed, overwrite)


def make_tiny_reranker(
    path: str | os.PathLike[str],
    model_type: str = "bert",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write a tiny random-weight reranker (a cross-encoder) that mlx-vlm's
    reranker loader (``mlx_vlm.reranker_loader.load_reranker``) loads
    offline.

    ``bert``: mlx-vlm's own BERT sequence classifier with one label (the
    encoder of :func:`make_tiny_embedding`, its first token pooled, then one
    logit), the same tokenizer, which writes a pair as ``[CLS] query [SEP]
    document [SEP]`` with segment ids 0 and 1.

    ``model_type`` is one of :data:`TINY_RERANKER_TYPES`; written, cached and
    replaced as :func:`make_tiny_vlm` does, with its arguments and errors.
    """
    family = family_of(_RERANKER, model_type, "make_tiny_reranker")
    return make(family, path, seed, overwrite)


def make_tiny_transcription(
    path: str | os.PathLike[str],
    model_type: str = "whisper",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write a tiny random-weight speech-to-text model that mlx-audio's
    loader (``mlx_audio.stt.utils.load_model``) loads offline.

    ``whisper``: mlx-audio's own Whisper class, multilingual (99 languages,
    transcribe and translate), an 80-mel, 1-layer, 32-wide audio encoder
    over Whisper's 30-second windows and a 2-layer, 32-wide text decoder of
    64 positions (so a window's answer is at most 32 tokens), with a
    vocabulary of Whisper's layout and size (51,865: the byte-level BPE
    tokens, unused ones, the special tokens, the timestamps), about 1.7M
    parameters. Greedy decoding picks text tokens only: it never ends a
    window early, so each window's answer takes its 32 tokens.
    ``parakeet``: mlx-audio's Parakeet CTC class (NeMo's layout, English
    only), a 1-layer, 32-wide Conformer over 80 log-mel features with 8x
    subsampling and a 61-piece vocabulary in its config, about 33k
    parameters.

    ``model_type`` is one of :data:`TINY_TRANSCRIPTION_TYPES`; written, cached and
    replaced as :func:`make_tiny_vlm` does, with its arguments and errors.
    """
    family = family_of(_TRANSCRIPTION, model_type, "make_tiny_transcription")
    return make(family, path, seed, overwrite)


def make_tiny_speech(
    path: str | os.PathLike[str],
    model_type: str = "qwen3_tts",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write a tiny random-weight text-to-speech model that mlx-audio's loader
    (``mlx_audio.tts.utils.load_model``) loads offline.

    ``qwen3_tts``: mlx-audio's own Qwen3-TTS CustomVoice classes, a 1-layer,
    32-wide talker and code predictor making frames of 4 codes, its speech
    tokenizer's decoder as the vocoder (1920 samples a frame at 24 kHz, 12.5
    frames a second), the voices ``ryan``, ``serena`` and ``vivian``, and a
    greedy generation config. Its end of speech is never picked, so it speaks
    until the frame limit it is given, and the same text and voice always
    give the same samples. Nothing is fetched at load or generation time.
    The first call in a process imports mlx-audio and builds the family's
    classes once, on a private thread.

    ``model_type`` is one of :data:`TINY_SPEECH_TYPES`; written, cached and replaced
    as :func:`make_tiny_vlm` does, with its arguments and errors.
    """
    family = family_of(_SPEECH, model_type, "make_tiny_speech")
    return make(family, path, seed, overwrite)


def make_tiny_omni(
    path: str | os.PathLike[str],
    model_type: str = "gemma4",
    *,
    seed: int = 0,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write a tiny random-weight chat model that takes audio (and images),
    which mlx-vlm loads offline.

    ``gemma4``: mlx-vlm's own Gemma 4 class, the 2-layer, 64-wide decoder of
    :func:`make_tiny_vlm` (both layers attending to everything, so the
    server's prompt cache takes part), a 2-layer, 32-wide vision tower (a
    64x64 image is 4 soft tokens) and a 1-layer, 32-wide Conformer audio
    tower over 128 log-mel bins at 16 kHz, 4x subsampled: a second of audio
    is 25 audio tokens, between ``<|audio>`` and ``<audio|>``. mlx-vlm's own
    Gemma 4 processor and feature extractor (no transformers processor, no
    hub). About 183k parameters.

    ``model_type`` is one of :data:`TINY_OMNI_TYPES`; written, cached and replaced
    as :func:`make_tiny_vlm` does, with its arguments and errors.
    """
    family = family_of(_OMNI, model_type, "make_tiny_omni")
    return make(family, path, seed, overwrite)


def family_of(known: Mapping[str, Family], model_type: str, function: str) -> Family:
    try:
        return known[model_type]
    except KeyError:
        raise ValueError(
            f"{function} writes one of {sorted(known)}, not {model_type!r}."
        ) from None


def make(
    family: Family, path: str | os.PathLike[str], seed: int, overwrite: bool
) -> pathlib.Path:
    return write_folder(
        pathlib.Path(path),
        lambda sizes: family.marker(seed, sizes),
        lambda folder: family.write(folder, seed),
        overwrite=overwrite,
    )
