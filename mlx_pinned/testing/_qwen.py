"""The Qwen families: Qwen3-VL, Qwen2.5-VL and the text-only Qwen3.

Calling thread. They share the tokenizer (Qwen's special tokens) and the
chat template (Qwen3's, with tools and optional thinking).
"""

from __future__ import annotations

import functools
from typing import Any, Final

from ._family import Family, flat, ids, nested
from ._tokenizer import VOCAB_SIZE, tokenizer_config

#: The tokenizer's special tokens, in id order (``<|endoftext|>`` is id 0).
SPECIAL_TOKENS: Final = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# Qwen2/3-VL style: no default system prompt; content is a string or a list of
# typed parts, images and videos wrapped in vision markers. Tools, tool calls
# and tool results as Qwen3's template writes them (Hermes' <tool_call>).
# enable_thinking (mlx-vlm passes false unless asked) opens <think> in the
# generation prompt, as Qwen3-VL-Thinking's template does: plain prompts stay
# as they were, and a request can switch thinking on.
_CHAT_TEMPLATE: Final = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}"
    "{{- part -}}"
    "{%- else -%}"
    "{%- set kind = part.get('type', '') -%}"
    "{%- if kind in ('image', 'image_url', 'input_image') or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif kind in ('video', 'video_url', 'input_video') or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- render(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the "
    "user query.\\n\\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' + (tool | tojson) -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:"
    '\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render(message['content']) "
    "+ '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- render(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first or message['content'] -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- set function = call['function'] if call.get('function') else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' -}}"
    "{%- if function['arguments'] is string -%}"
    "{{- function['arguments'] -}}"
    "{%- else -%}"
    "{{- function['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is true -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": _IDS["<|endoftext|>"],
        "eos_token_id": [_IDS["<|im_end|>"], _IDS["<|endoftext|>"]],
        "pad_token_id": _IDS["<|endoftext|>"],
    }


def _tokenizer_config() -> dict[str, Any]:
    return tokenizer_config(
        SPECIAL_TOKENS,
        _CHAT_TEMPLATE,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
    )


def qwen3_vision_config(model_type: str, *, deepstack: list[int]) -> dict[str, Any]:
    """The 2-layer, 32-wide vision tower of Qwen3-VL and Qwen3.5 (patch 16,
    merged 2x2); ``deepstack``: the layers whose features feed the decoder."""
    return {
        "model_type": model_type,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": deepstack,
        "hidden_act": "gelu_pytorch_tanh",
    }


def qwen_text_config(model_type: str) -> dict[str, Any]:
    """The 2-layer, 64-wide decoder all the Qwen families here share."""
    return {
        "model_type": model_type,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": _IDS["<|endoftext|>"],
        "eos_token_id": _IDS["<|im_end|>"],
        "dtype": "float32",
    }


def media_ids() -> dict[str, int]:
    return {
        "image_token_id": _IDS["<|image_pad|>"],
        "video_token_id": _IDS["<|video_pad|>"],
        "vision_start_token_id": _IDS["<|vision_start|>"],
        "vision_end_token_id": _IDS["<|vision_end|>"],
        "vision_token_id": _IDS["<|vision_pad|>"],
    }


# -- Qwen3-VL ------------------------------------------------------------------


def _qwen3_vl_config() -> dict[str, Any]:
    text = {
        **qwen_text_config("qwen3_vl_text"),
        "rope_theta": 5000000.0,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": qwen3_vision_config("qwen3_vl", deepstack=[0]),
        **media_ids(),
        "tie_word_embeddings": True,
        "vocab_size": VOCAB_SIZE,
        "dtype": "float32",
    }


def _pixel_settings(patch: int, min_pixels: int, max_pixels: int) -> dict[str, Any]:
    return {
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "do_convert_rgb": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def qwen_vl_files(
    config: dict[str, Any], processor: str, video: str, patch: int
) -> dict[str, Any]:
    # 32*32 .. 128*128 pixels: with patch 16, a 64x64 image stays 64x64, 4x4
    # patches, and the 2x2 merge makes 4 image tokens.
    pixels = _pixel_settings(patch, 32 * 32, 128 * 128)
    return {
        "config.json": config,
        "generation_config.json": _generation_config(),
        "tokenizer_config.json": _tokenizer_config(),
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": processor,
            **pixels,
        },
        # Without these two the processor asks the hub for them.
        "video_preprocessor_config.json": {
            "video_processor_type": video,
            "processor_class": processor,
            "fps": 2,
            "min_frames": 2,
            "max_frames": 8,
            **pixels,
        },
        "processor_config.json": {"processor_class": processor},
    }


QWEN3_VL: Final = Family(
    model_type="qwen3_vl",
    module="mlx_vlm.models.qwen3_vl",
    specials=SPECIAL_TOKENS,
    files=lambda: qwen_vl_files(
        _qwen3_vl_config(), "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16
    ),
    build=lambda module: nested(module, _qwen3_vl_config()),
    marked=False,
)


# -- Qwen2.5-VL ----------------------------------------------------------------


def _qwen2_5_vl_config() -> dict[str, Any]:
    text = {
        **qwen_text_config("qwen2_5_vl"),
        "rope_theta": 1000000.0,
        # Not interleaved: temporal, height, width sections in a row.
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }
    vision = {
        "model_type": "qwen2_5_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        # Windowed attention in block 0, full attention in block 1.
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
    }
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        **{k: v for k, v in text.items() if k != "model_type"},
        "text_config": text,
        "vision_config": vision,
        **media_ids(),
        "tie_word_embeddings": True,
        "vocab_size": VOCAB_SIZE,
        "dtype": "float32",
    }


def _build_qwen2_5_vl(module: Any) -> Any:
    # Its ModelConfig.from_dict makes the text config from the root keys, as
    # a dict; the loader converts both nested configs afterwards.
    config = module.ModelConfig.from_dict(_qwen2_5_vl_config())
    config.text_config = module.TextConfig.from_dict(config.text_config)
    config.vision_config = module.VisionConfig.from_dict(config.vision_config)
    return module.Model(config)


QWEN2_5_VL: Final = Family(
    model_type="qwen2_5_vl",
    module="mlx_vlm.models.qwen2_5_vl",
    specials=SPECIAL_TOKENS,
    files=lambda: qwen_vl_files(
        _qwen2_5_vl_config(), "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", 14
    ),
    build=lambda module: _build_qwen2_5_vl(module),
)


# -- Qwen3, text only ------------------------------------------------------------


@functools.cache
def _qwen3_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        **qwen_text_config("qwen3"),
        "rope_theta": 1000000.0,
        "attention_bias": False,
    }


QWEN3: Final = Family(
    model_type="qwen3",
    module="mlx_vlm.models.qwen3",
    specials=SPECIAL_TOKENS,
    files=lambda: {
        "config.json": _qwen3_config(),
        "generation_config.json": _generation_config(),
        "tokenizer_config.json": _tokenizer_config(),
    },
    build=lambda module: flat(module, _qwen3_config()),
    vision=False,
    generator="mlx_pinned.testing.make_tiny_lm",
)
