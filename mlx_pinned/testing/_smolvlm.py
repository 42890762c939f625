"""SmolVLM: a SigLIP tower whose image is split into tiles plus a global
view, pixel-shuffled 2x2, before a Llama decoder. Calling thread.
"""

from __future__ import annotations

from typing import Any, Final

from ._family import Family, ids, nested, siglip_tower
from ._tokenizer import VOCAB_SIZE, tokenizer_config

# The largest split here is 2x2 tiles, so four row/column tokens.
SPECIAL_TOKENS: Final = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<global-img>",
    "<image>",
    "<row_1_col_1>",
    "<row_1_col_2>",
    "<row_2_col_1>",
    "<row_2_col_2>",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# SmolVLM's: "User:" / "Assistant:" turns ended by <end_of_utterance>, an
# image part as <image> (the processor expands it into tiles).
_CHAT_TEMPLATE: Final = (
    "<|im_start|>"
    "{%- for message in messages -%}"
    "{{- message['role'] | capitalize -}}"
    "{%- if message['content'] is string -%}"
    "{{- ': ' + message['content'] -}}"
    "{%- else -%}"
    "{%- if message['content'] and message['content'][0].get('type', '') "
    "in ('image', 'image_url') -%}"
    "{{- ':' -}}"
    "{%- else -%}"
    "{{- ': ' -}}"
    "{%- endif -%}"
    "{%- for part in message['content'] or [] -%}"
    "{%- if part.get('type', '') in ('image', 'image_url') -%}"
    "{{- '<image>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_utterance>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- 'Assistant:' -}}"
    "{%- endif -%}"
)

# Tiles of 32x32 pixels, 8x8 patches each, shuffled 2x2: 4 image tokens a
# tile; an image is resized to 64 pixels on its longer side at most, so a
# 64x64 image is 2x2 tiles and a global view.
_TILE: Final = 32
_TILE_TOKENS: Final = 4


def _config() -> dict[str, Any]:
    text = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }
    vision = siglip_tower(_TILE, 8)
    return {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "text_config": text,
        "vision_config": vision,
        "scale_factor": 2,
        "image_token_id": _IDS["<image>"],
        "eos_token_id": [_IDS["<end_of_utterance>"]],
        "pad_token_id": _IDS["<|endoftext|>"],
        "vocab_size": VOCAB_SIZE,
        "dtype": "float32",
    }


def _files() -> dict[str, Any]:
    return {
        "config.json": _config(),
        "generation_config.json": {
            "bos_token_id": _IDS["<|im_start|>"],
            "eos_token_id": [_IDS["<end_of_utterance>"], _IDS["<|endoftext|>"]],
            "pad_token_id": _IDS["<|endoftext|>"],
        },
        "tokenizer_config.json": tokenizer_config(
            SPECIAL_TOKENS,
            _CHAT_TEMPLATE,
            bos="<|im_start|>",
            eos="<end_of_utterance>",
            pad="<|endoftext|>",
        ),
        "preprocessor_config.json": {
            "image_processor_type": "SmolVLMImageProcessor",
            "processor_class": "SmolVLMProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"longest_edge": 2 * _TILE},
            "max_image_size": {"longest_edge": _TILE},
            "do_image_splitting": True,
            "resample": 1,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pad": True,
        },
        "processor_config.json": {
            "processor_class": "SmolVLMProcessor",
            "image_seq_len": _TILE_TOKENS,
        },
    }


SMOLVLM: Final = Family(
    model_type="smolvlm",
    module="mlx_vlm.models.smolvlm",
    specials=SPECIAL_TOKENS,
    files=_files,
    build=lambda module: nested(module, _config()),
)
