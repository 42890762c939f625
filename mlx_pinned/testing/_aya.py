"""Aya Vision: a SigLIP tower on tiles plus a global view, pixel-shuffled
2x2, before a Cohere 2 decoder whose sliding-window layers use RoPE and
whose global layers use no positions at all. Calling thread.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import (
    SIGLIP_PATCH,
    SIGLIP_SIDE,
    SLIDING_WINDOW,
    decoder,
    processor_files,
    siglip_tower,
    token_files,
    vision_model,
)
from ._family import Family
from ._templates import content, generation_prompt, template
from ._tokenizer import ids

SPECIAL_TOKENS: Final = (
    "<PAD>",
    "<UNK>",
    "<BOS_TOKEN>",
    "<EOS_TOKEN>",
    "<|START_OF_TURN_TOKEN|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
    "<image>",
    "<|START_OF_IMG|>",
    "<|END_OF_IMG|>",
    "<|IMG_PATCH|>",
    "<|IMG_LINE_BREAK|>",
    "TILE",
    "TILE_GLOBAL",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# Cohere's turns; an image part as <image>, which the processor expands into
# <|START_OF_IMG|>, TILE_n and TILE_GLOBAL, each with its patches, and
# <|END_OF_IMG|>.
_CHAT_TEMPLATE: Final = template(
    "{{- bos_token -}}"
    "{%- set roles = {'user': 'USER', 'assistant': 'CHATBOT', 'system': 'SYSTEM'} -%}"
    "{%- for message in messages -%}"
    "{{- '<|START_OF_TURN_TOKEN|><|' + roles[message['role']] + '_TOKEN|>' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|START_RESPONSE|>' -}}"
    "{%- endif -%}",
    content("<image>"),
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|END_RESPONSE|>' -}}"
    "{%- endif -%}"
    "{{- '<|END_OF_TURN_TOKEN|>' -}}"
    "{%- endfor -%}",
    generation_prompt("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>"),
)


def _config() -> dict[str, Any]:
    text = decoder(
        "cohere2",
        rope_theta=50000.0,
        layer_norm_eps=1e-5,
        logit_scale=0.0625,
        # Layer 0 slides (with RoPE), layer 1 attends to everything (no RoPE).
        sliding_window=SLIDING_WINDOW,
        sliding_window_pattern=2,
        max_position_embeddings=8192,
    )
    return vision_model(
        "AyaVisionForConditionalGeneration",
        "aya_vision",
        text,
        siglip_tower(),
        image_token_index=_IDS["<|IMG_PATCH|>"],
        downsample_factor=2,
        max_splits_per_img=2,
        alignment_intermediate_size=128,
        adapter_layer_norm_eps=1e-6,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        eos_token_id=[_IDS["<|END_OF_TURN_TOKEN|>"]],
    )


def _files() -> dict[str, Any]:
    # A tile is one SigLIP input; up to 2 tiles and the global view.
    image = {
        "size": {"height": SIGLIP_SIDE, "width": SIGLIP_SIDE},
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 2,
        "do_resize": True,
        "resample": 3,
    }
    return {
        **token_files(
            SPECIAL_TOKENS,
            _CHAT_TEMPLATE,
            bos="<BOS_TOKEN>",
            eos="<|END_OF_TURN_TOKEN|>",
            pad="<PAD>",
            stops=("<EOS_TOKEN>",),
        ),
        **processor_files(
            "GotOcr2ImageProcessor",
            "AyaVisionProcessor",
            image,
            patch_size=SIGLIP_PATCH,
            img_size=SIGLIP_SIDE,
            downsample_factor=2,
        ),
    }


AYA_VISION: Final = Family("aya_vision", SPECIAL_TOKENS, _config, _files)
