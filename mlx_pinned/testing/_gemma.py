"""The Gemma families: Gemma 3 (a SigLIP tower, pooled, before a Gemma 3
decoder with sliding-window layers) and PaliGemma (a SigLIP tower before a
Gemma decoder). Calling thread.

They share a tokenizer with Gemma's special tokens and the image tokens of
both (Gemma 3's ``<start_of_image>`` and ``<image_soft_token>``,
PaliGemma's ``<image>``).
"""

from __future__ import annotations

from typing import Any, Final

from ._family import Family, ids, nested, siglip_tower
from ._tokenizer import VOCAB_SIZE, tokenizer_config

SPECIAL_TOKENS: Final = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<image>",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# Gemma 3's layout: a system message is prepended to the first user turn, the
# assistant is "model", an image part is <start_of_image> (the processor
# expands it into the image's soft tokens between <start_of_image> and
# <end_of_image>).
_GEMMA3_TEMPLATE: Final = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if loop.first -%}{{- first_user_prefix -}}{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] | trim -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part is string -%}"
    "{{- part | trim -}}"
    "{%- elif part.get('type', '') in ('image', 'image_url') -%}"
    "{{- '<start_of_image>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] | trim -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<start_of_turn>model\\n' -}}"
    "{%- endif -%}"
)


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": _IDS["<bos>"],
        "eos_token_id": [_IDS["<eos>"], _IDS["<end_of_turn>"]],
        "pad_token_id": _IDS["<pad>"],
    }


def _tokenizer_config(template: str, **extra: Any) -> dict[str, Any]:
    return tokenizer_config(
        SPECIAL_TOKENS, template, bos="<bos>", eos="<eos>", pad="<pad>", **extra
    )


def _image_processor(kind: str, side: int, processor: str) -> dict[str, Any]:
    return {
        "image_processor_type": kind,
        "processor_class": processor,
        "size": {"height": side, "width": side},
        "resample": 2,
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


# -- Gemma 3 -------------------------------------------------------------------

# A 32x32 image of 8x8 patches, pooled 2x2: 4 soft tokens per image.
_GEMMA3_SIDE: Final = 32
_GEMMA3_IMAGE_TOKENS: Final = 4
# Small enough that prompts and answers of a few tokens go past it, so the
# sliding-window layers' rotating caches wrap in tests.
GEMMA3_SLIDING_WINDOW: Final = 16


def _gemma3_config() -> dict[str, Any]:
    text = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "rope_global_base_freq": 1000000.0,
        "rope_local_base_freq": 10000.0,
        # Layer 0 slides, layer 1 attends to everything.
        "sliding_window": GEMMA3_SLIDING_WINDOW,
        "sliding_window_pattern": 2,
        "mm_tokens_per_image": _GEMMA3_IMAGE_TOKENS,
        "max_position_embeddings": 32768,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": siglip_tower(_GEMMA3_SIDE, 8),
        "boi_token_index": _IDS["<start_of_image>"],
        "eoi_token_index": _IDS["<end_of_image>"],
        "image_token_index": _IDS["<image_soft_token>"],
        "mm_tokens_per_image": _GEMMA3_IMAGE_TOKENS,
        "hidden_size": 64,
        "pad_token_id": _IDS["<pad>"],
        "eos_token_id": [_IDS["<eos>"], _IDS["<end_of_turn>"]],
        "vocab_size": VOCAB_SIZE,
        "dtype": "float32",
    }


def _gemma3_files() -> dict[str, Any]:
    return {
        "config.json": _gemma3_config(),
        "generation_config.json": _generation_config(),
        "tokenizer_config.json": _tokenizer_config(
            _GEMMA3_TEMPLATE,
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        ),
        "preprocessor_config.json": {
            **_image_processor("Gemma3ImageProcessor", _GEMMA3_SIDE, "Gemma3Processor"),
            "do_pan_and_scan": False,
        },
        "processor_config.json": {
            "processor_class": "Gemma3Processor",
            "image_seq_length": _GEMMA3_IMAGE_TOKENS,
        },
    }


GEMMA3: Final = Family(
    model_type="gemma3",
    module="mlx_vlm.models.gemma3",
    specials=SPECIAL_TOKENS,
    files=_gemma3_files,
    build=lambda module: nested(module, _gemma3_config()),
)
