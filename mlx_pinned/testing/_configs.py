"""The config pieces the tiny families share: the decoder's size, a vision
model's root keys, SigLIP's tower, image scaling and the generation config.

Calling thread; plain dicts, no MLX.
"""

from __future__ import annotations

from typing import Any

from ._tokenizer import VOCAB_SIZE, ids


def decoder(model_type: str, **settings: Any) -> dict[str, Any]:
    """The 2-layer, 64-wide decoder of every family (4 query heads, 2 KV
    heads), with the family's own ``settings``."""
    return {
        "model_type": model_type,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB_SIZE,
        **settings,
    }


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


def siglip_tower(side: int, patch: int) -> dict[str, Any]:
    """A 2-layer, 32-wide SigLIP vision tower for ``side``-pixel images
    (Gemma 3, SmolVLM and Aya Vision use one)."""
    return {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": patch,
        "image_size": side,
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


def image_processor(kind: str, processor: str, **settings: Any) -> dict[str, Any]:
    """``preprocessor_config.json``: the image processor class ``kind`` of
    ``processor``, with :func:`scaled_rgb` and the family's ``settings``."""
    return {
        "image_processor_type": kind,
        "processor_class": processor,
        **scaled_rgb(),
        **settings,
    }


def generation_config(
    specials: tuple[str, ...], *, bos: str, eos: str | list[str], pad: str
) -> dict[str, Any]:
    """``generation_config.json``, naming its tokens by their text; ``eos``
    a list where generation stops at any of several tokens."""
    index = ids(specials)
    return {
        "bos_token_id": index[bos],
        "eos_token_id": (
            index[eos] if isinstance(eos, str) else [index[token] for token in eos]
        ),
        "pad_token_id": index[pad],
    }
