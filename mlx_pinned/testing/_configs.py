"""The config pieces the families share: the sizes they are written at, the
decoder, a vision model's root keys, SigLIP's tower, the processor and the
token files.

Calling thread; plain dicts, no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from ._tokenizer import VOCAB_SIZE, ids, tokenizer_config


@dataclass(frozen=True)
class Size:
    """The widths a family is written at; the family decides its own layout
    (which layers slide, how its heads split) from them.

    Attributes:
        name: ``tiny`` or ``bench``: the writers' and cached folders' word.
        layers, hidden, intermediate, heads, kv_heads, head_dim: The
            decoder's layers, width, MLP width, query and KV heads, head size.
        vocab: Tokens in the vocabulary (the tokenizer is padded to it).
        dtype: The weights' type.
        window: The sliding window of a family's sliding-window layers.
        tower_layers, tower_hidden, tower_intermediate, tower_heads: The
            vision tower's.
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    window: int
    tower_layers: int
    tower_hidden: int
    tower_intermediate: int
    tower_heads: int


#: The tests' models: a step is mostly Python. The window is short enough
#: that tests' prompts and answers pass it, so rotating caches wrap.
TINY: Final = Size(
    "tiny", 2, 64, 128, 4, 2, 16, VOCAB_SIZE, "float32", 16, 2, 32, 64, 2
)
#: The benchmarks' models: a small real model's proportions (Qwen3's 3x MLP,
#: heads of 64, twice the query heads as KV heads), a real vocabulary's
#: sampling cost and a real model's weight type, so compute, not Python,
#: fills a step.
BENCH: Final = Size(
    "bench", 6, 512, 1536, 8, 4, 64, 32768, "bfloat16", 512, 4, 256, 1024, 4
)


def decoder(
    model_type: str, *, size: Size = TINY, head_dim: bool = True, **settings: Any
) -> dict[str, Any]:
    """The decoder of every family at ``size``, with the family's own
    ``settings`` (which win).

    ``head_dim=False`` leaves the head size out of the config, for a family
    whose real config derives it.
    """
    config = {
        "model_type": model_type,
        "num_hidden_layers": size.layers,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "vocab_size": size.vocab,
        **settings,
    }
    if head_dim:
        config["head_dim"] = size.head_dim
    return config


def tied_decoder(
    model_type: str,
    specials: tuple[str, ...],
    *,
    bos: str,
    eos: str,
    size: Size = TINY,
    **settings: Any,
) -> dict[str, Any]:
    """:func:`decoder` as Llama's and the Qwen families' configs have it:
    SiLU, tied embeddings, float32, and the ids of its ``bos`` and ``eos``
    tokens."""
    index = ids(specials)
    return decoder(
        model_type,
        size=size,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=index[bos],
        eos_token_id=index[eos],
        dtype=size.dtype,
        **settings,
    )


# Gemma 3's and Aya Vision's sliding-window layers at the tiny size.
SLIDING_WINDOW: Final = TINY.window


def vision_model(
    architecture: str,
    model_type: str,
    text: dict[str, Any],
    vision: dict[str, Any],
    size: Size = TINY,
    **settings: Any,
) -> dict[str, Any]:
    """``config.json`` of a vision family at ``size``: its text and vision
    configs nested, with the family's own root ``settings``."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        **settings,
        "vocab_size": size.vocab,
        "dtype": size.dtype,
    }


# SigLIP's input in Gemma 3, SmolVLM and Aya Vision: an image (or a tile) of
# 32x32 pixels in 8x8 patches, reduced 2x2 (pooled or pixel-shuffled) to 4
# image tokens.
SIGLIP_SIDE: Final = 32
SIGLIP_PATCH: Final = 8
SIGLIP_TOKENS: Final = 4


def siglip_tower(size: Size = TINY) -> dict[str, Any]:
    """The SigLIP vision tower of Gemma 3, SmolVLM and Aya Vision."""
    return {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": size.tower_layers,
        "hidden_size": size.tower_hidden,
        "intermediate_size": size.tower_intermediate,
        "num_attention_heads": size.tower_heads,
        "patch_size": SIGLIP_PATCH,
        "image_size": SIGLIP_SIDE,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }


def scaled_rgb() -> dict[str, Any]:
    """Processor settings every family shares: RGB, scaled to 0..1, then
    normalised around 0.5."""
    return {
        "do_convert_rgb": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def processor_files(
    kind: str, processor: str, image: dict[str, Any], **settings: Any
) -> dict[str, Any]:
    """``preprocessor_config.json`` (the image processor class ``kind``,
    :func:`scaled_rgb` and ``image``) and ``processor_config.json``
    (``settings``) of the processor class ``processor``."""
    return {
        "preprocessor_config.json": {
            "image_processor_type": kind,
            "processor_class": processor,
            **scaled_rgb(),
            **image,
        },
        "processor_config.json": {"processor_class": processor, **settings},
    }


def token_files(
    specials: tuple[str, ...],
    chat_template: str,
    *,
    bos: str | None,
    eos: str,
    pad: str,
    stops: tuple[str, ...] = (),
    **extra: Any,
) -> dict[str, Any]:
    """``tokenizer_config.json`` and ``generation_config.json``.

    Args:
        specials: The family's special tokens, in id order.
        chat_template: Its Jinja chat template.
        bos: Its beginning-of-sequence token; where it has none, the
            generation config names ``pad`` instead, as Qwen's does.
        eos: The token that ends a turn.
        pad: The padding token.
        stops: Other tokens generation stops at; with any, the generation
            config lists ``eos`` and these, else it names ``eos`` alone.
        **extra: More ``tokenizer_config.json`` keys.
    """
    index = ids(specials)
    return {
        "tokenizer_config.json": tokenizer_config(
            specials, chat_template, bos=bos, eos=eos, pad=pad, **extra
        ),
        "generation_config.json": {
            "bos_token_id": index[pad if bos is None else bos],
            "eos_token_id": (
                [index[token] for token in (eos, *stops)] if stops else index[eos]
            ),
            "pad_token_id": index[pad],
        },
    }
