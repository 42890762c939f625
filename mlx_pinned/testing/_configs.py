"""The config pieces the tiny families share: the decoder's size, a vision
model's root keys, SigLIP's tower, the processor and the token files.

Calling thread; plain dicts, no MLX.
"""

from __future__ import annotations

from typing import Any, Final

from ._tokenizer import VOCAB_SIZE, ids, tokenizer_config


def decoder(
    model_type: str, *, head_dim: int | None = 16, **settings: Any
) -> dict[str, Any]:
    """The 2-layer, 64-wide decoder of every family (4 query heads of 16, 2
    KV heads), with the family's own ``settings``.

    ``head_dim=None`` leaves the head size out of the config, for a family
    whose real config derives it.
    """
    config = {
        "model_type": model_type,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB_SIZE,
        **settings,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config


def tied_decoder(
    model_type: str, specials: tuple[str, ...], *, bos: str, eos: str, **settings: Any
) -> dict[str, Any]:
    """:func:`decoder` as Llama's and the Qwen families' configs have it:
    SiLU, tied embeddings, float32, and the ids of its ``bos`` and ``eos``
    tokens."""
    index = ids(specials)
    return decoder(
        model_type,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=index[bos],
        eos_token_id=index[eos],
        dtype="float32",
        **settings,
    )


# Short enough that tests' prompts and answers pass it, so the sliding-window
# layers' rotating caches wrap (Gemma 3 and Aya Vision have such layers).
SLIDING_WINDOW: Final = 16


def vision_model(
    architecture: str,
    model_type: str,
    text: dict[str, Any],
    vision: dict[str, Any],
    **settings: Any,
) -> dict[str, Any]:
    """``config.json`` of a vision family: its text and vision configs
    nested, float32, with the family's own root ``settings``."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        **settings,
        "vocab_size": VOCAB_SIZE,
        "dtype": "float32",
    }


# SigLIP's input in Gemma 3, SmolVLM and Aya Vision: an image (or a tile) of
# 32x32 pixels in 8x8 patches, reduced 2x2 (pooled or pixel-shuffled) to 4
# image tokens.
SIGLIP_SIDE: Final = 32
SIGLIP_PATCH: Final = 8
SIGLIP_TOKENS: Final = 4


def siglip_tower() -> dict[str, Any]:
    """The 2-layer, 32-wide SigLIP vision tower of Gemma 3, SmolVLM and Aya
    Vision."""
    return {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
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
