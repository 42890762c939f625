"""The Llama families: Llama (text only) and LLaVA (a CLIP tower before a
Llama decoder). Calling thread.

They share a tokenizer with Llama 3's special tokens plus LLaVA's
``<image>``, and a Llama 3 style chat template.
"""

from __future__ import annotations

import functools
from typing import Any, Final

from ._family import Family, flat, ids
from ._tokenizer import VOCAB_SIZE, tokenizer_config

SPECIAL_TOKENS: Final = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# Llama 3's layout; content is a string or typed parts, an image part
# becoming LLaVA's <image> placeholder (the processor expands it).
CHAT_TEMPLATE: Final = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part is string -%}"
    "{{- part -}}"
    "{%- elif part.get('type', '') in ('image', 'image_url') -%}"
    "{{- '<image>\\n' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": _IDS["<|begin_of_text|>"],
        "eos_token_id": [_IDS["<|eot_id|>"], _IDS["<|end_of_text|>"]],
        "pad_token_id": _IDS["<|end_of_text|>"],
    }


def _tokenizer_config() -> dict[str, Any]:
    return tokenizer_config(
        SPECIAL_TOKENS,
        CHAT_TEMPLATE,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
    )


def _text_config(model_type: str) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "bos_token_id": _IDS["<|begin_of_text|>"],
        "eos_token_id": _IDS["<|eot_id|>"],
        "dtype": "float32",
    }


@functools.cache
def _llama_config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], **_text_config("llama")}


LLAMA: Final = Family(
    model_type="llama",
    module="mlx_vlm.models.llama",
    specials=SPECIAL_TOKENS,
    files=lambda: {
        "config.json": _llama_config(),
        "generation_config.json": _generation_config(),
        "tokenizer_config.json": _tokenizer_config(),
    },
    build=lambda module: flat(module, _llama_config()),
    vision=False,
    generator="mlx_pinned.testing.make_tiny_lm",
)
