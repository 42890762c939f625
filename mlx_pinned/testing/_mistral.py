"""Mistral 3: a Pixtral tower (2D RoPE over the patch grid, any aspect
ratio, no fixed size) whose patches are merged 2x2 before a Mistral decoder.
Calling thread.
"""

from __future__ import annotations

from typing import Any, Final

from ._family import Family, ids, nested
from ._tokenizer import VOCAB_SIZE, tokenizer_config

SPECIAL_TOKENS: Final = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# Mistral Small 3.1's layout: the system prompt in its own markers, user
# turns in [INST] ... [/INST], an image part as [IMG] (the processor expands
# it into rows of [IMG] separated by [IMG_BREAK], ended by [IMG_END]), an
# assistant turn ended by </s>.
_CHAT_TEMPLATE: Final = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '[SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST]' -}}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part.get('type', '') in ('image', 'image_url') -%}"
    "{{- '[IMG]' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[/INST]' -}}"
    "{%- else -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Patches of 8 pixels merged 2x2: a token per 16x16 pixels, an image resized
# to 64 pixels on its longer side at most: a 64x64 image is 4 rows of 4.
_PATCH: Final = 8
_LONGEST: Final = 64


def _config() -> dict[str, Any]:
    text = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "rope_theta": 1000000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "pixtral",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": _LONGEST,
        "patch_size": _PATCH,
        "num_channels": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    return {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "text_config": text,
        "vision_config": vision,
        "image_token_index": _IDS["[IMG]"],
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "multimodal_projector_bias": False,
        "eos_token_id": [_IDS["</s>"]],
        "vocab_size": VOCAB_SIZE,
        "dtype": "float32",
    }


def _files() -> dict[str, Any]:
    return {
        "config.json": _config(),
        "generation_config.json": {
            "bos_token_id": _IDS["<s>"],
            "eos_token_id": _IDS["</s>"],
            "pad_token_id": _IDS["<unk>"],
        },
        "tokenizer_config.json": tokenizer_config(
            SPECIAL_TOKENS, _CHAT_TEMPLATE, bos="<s>", eos="</s>", pad="<unk>"
        ),
        "preprocessor_config.json": {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "Mistral3Processor",
            "size": {"longest_edge": _LONGEST},
            "patch_size": {"height": _PATCH, "width": _PATCH},
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        "processor_config.json": {
            "processor_class": "Mistral3Processor",
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
            "patch_size": _PATCH,
            "spatial_merge_size": 2,
        },
    }


MISTRAL3: Final = Family(
    model_type="mistral3",
    module="mlx_vlm.models.mistral3",
    specials=SPECIAL_TOKENS,
    files=_files,
    build=lambda module: nested(module, _config()),
)
