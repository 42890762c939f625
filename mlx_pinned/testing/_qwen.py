"""The Qwen families: Qwen3-VL, Qwen2.5-VL and the text-only Qwen3.

Calling thread. They share the tokenizer (Qwen's special tokens) and the
chat template (Qwen3's, with tools and optional thinking).
"""

from __future__ import annotations

import functools
from typing import Any, Final

from ._configs import (
    TINY,
    Size,
    processor_files,
    scaled_rgb,
    tied_decoder,
    token_files,
    vision_model,
)
from ._family import Family, flat
from ._tokenizer import ids

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


def qwen_tower(
    model_type: str, patch: int, size: Size = TINY, **settings: Any
) -> dict[str, Any]:
    """The vision tower of every Qwen family here (merged 2x2), with the
    family's own ``settings``."""
    return {
        "model_type": model_type,
        "depth": size.tower_layers,
        "hidden_size": size.tower_hidden,
        "intermediate_size": size.tower_intermediate,
        "num_heads": size.tower_heads,
        "out_hidden_size": size.hidden,
        "in_channels": 3,
        "patch_size": patch,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **settings,
    }


def qwen3_vision_config(
    model_type: str, *, deepstack: list[int], size: Size = TINY
) -> dict[str, Any]:
    """The vision tower of Qwen3-VL and Qwen3.5 (patch 16); ``deepstack``:
    the layers whose features feed the decoder."""
    return qwen_tower(
        model_type,
        16,
        size,
        num_position_embeddings=16,
        deepstack_visual_indexes=deepstack,
        hidden_act="gelu_pytorch_tanh",
    )


def qwen_text_config(
    model_type: str, size: Size = TINY, **settings: Any
) -> dict[str, Any]:
    """The decoder all the Qwen families here share."""
    return tied_decoder(
        model_type,
        SPECIAL_TOKENS,
        bos="<|endoftext|>",
        eos="<|im_end|>",
        size=size,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        **settings,
    )


def mrope_section(rotated: int) -> list[int]:
    """Qwen3-VL's split of ``rotated`` dimensions' frequency pairs into
    temporal, height and width sections: 24:20:20, as its 128-wide heads."""
    pairs = rotated // 2
    side = pairs * 5 // 16
    return [pairs - 2 * side, side, side]


def qwen_media() -> dict[str, Any]:
    """Root keys of a Qwen vision family's ``config.json``: its media token
    ids, and tied embeddings."""
    return {
        "image_token_id": _IDS["<|image_pad|>"],
        "video_token_id": _IDS["<|video_pad|>"],
        "vision_start_token_id": _IDS["<|vision_start|>"],
        "vision_end_token_id": _IDS["<|vision_end|>"],
        "vision_token_id": _IDS["<|vision_pad|>"],
        "tie_word_embeddings": True,
    }


def _token_files() -> dict[str, Any]:
    return token_files(
        SPECIAL_TOKENS,
        _CHAT_TEMPLATE,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=("<|endoftext|>",),
    )


def qwen_vl_files(processor: str, video: str, patch: int) -> dict[str, Any]:
    """Every JSON file of a Qwen vision family but ``config.json``."""
    # 32*32 .. 128*128 pixels: with patch 16, a 64x64 image stays 64x64, 4x4
    # patches, and the 2x2 merge makes 4 image tokens.
    low, high = 32 * 32, 128 * 128
    pixels = {
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": low,
        "max_pixels": high,
        "size": {"shortest_edge": low, "longest_edge": high},
    }
    return {
        **_token_files(),
        **processor_files("Qwen2VLImageProcessor", processor, pixels),
        # Without these two the processor asks the hub for them.
        "video_preprocessor_config.json": {
            "video_processor_type": video,
            "processor_class": processor,
            "fps": 2,
            "min_frames": 2,
            "max_frames": 8,
            **scaled_rgb(),
            **pixels,
        },
    }


def qwen3_vl_files() -> dict[str, Any]:
    """The processor files of Qwen3-VL, which Qwen3.5 uses too."""
    return qwen_vl_files("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16)


# -- Qwen3-VL ------------------------------------------------------------------


def _qwen3_vl_config(size: Size = TINY) -> dict[str, Any]:
    text = qwen_text_config(
        "qwen3_vl_text",
        size,
        rope_theta=5000000.0,
        rope_scaling={
            "rope_type": "default",
            "mrope_section": mrope_section(size.head_dim),
            "mrope_interleaved": True,
        },
        attention_bias=False,
    )
    return vision_model(
        "Qwen3VLForConditionalGeneration",
        "qwen3_vl",
        text,
        qwen3_vision_config("qwen3_vl", deepstack=[0], size=size),
        size,
        **qwen_media(),
    )


QWEN3_VL: Final = Family(
    "qwen3_vl",
    SPECIAL_TOKENS,
    _qwen3_vl_config,
    qwen3_vl_files,
    marked=False,
    sized=_qwen3_vl_config,
)


# -- Qwen3-VL-Embedding ----------------------------------------------------------


def _qwen3_vl_embedding_config() -> dict[str, Any]:
    # Qwen3-VL itself, renamed: mlx-vlm's embedding class is Qwen3-VL's with
    # no LM head, its last token pooled and normalised (``normalize``).
    config = _qwen3_vl_config()
    return {
        **config,
        "architectures": ["Qwen3VLForEmbedding"],
        "model_type": "qwen3_vl_embedding",
        "normalize": True,
    }


QWEN3_VL_EMBEDDING: Final = Family(
    "qwen3_vl_embedding",
    SPECIAL_TOKENS,
    _qwen3_vl_embedding_config,
    qwen3_vl_files,
    generator="make_tiny_embedding",
)


# -- Qwen2.5-VL ----------------------------------------------------------------


def _qwen2_5_vl_config() -> dict[str, Any]:
    text = qwen_text_config(
        "qwen2_5_vl",
        rope_theta=1000000.0,
        # Not interleaved: temporal, height, width sections in a row.
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )
    vision = qwen_tower(
        "qwen2_5_vl",
        14,
        spatial_patch_size=14,
        # Windowed attention in block 0, full attention in block 1.
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    # Its ModelConfig reads the text settings from the root keys too.
    root = {k: v for k, v in text.items() if k != "model_type"}
    return vision_model(
        "Qwen2_5_VLForConditionalGeneration",
        "qwen2_5_vl",
        text,
        vision,
        **root | qwen_media(),
    )


def _build_qwen2_5_vl(module: Any, config: dict[str, Any]) -> Any:
    # Its ModelConfig.from_dict makes the text config from the root keys, as
    # a dict; the loader converts both nested configs afterwards.
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = module.VisionConfig.from_dict(
        model_config.vision_config
    )
    return module.Model(model_config)


QWEN2_5_VL: Final = Family(
    "qwen2_5_vl",
    SPECIAL_TOKENS,
    _qwen2_5_vl_config,
    lambda: qwen_vl_files("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", 14),
    build=_build_qwen2_5_vl,
)


# -- Qwen3, text only ------------------------------------------------------------


@functools.cache
def _qwen3_config(size: Size = TINY) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        **qwen_text_config("qwen3", size, rope_theta=1000000.0, attention_bias=False),
    }


QWEN3: Final = Family(
    "qwen3",
    SPECIAL_TOKENS,
    _qwen3_config,
    _token_files,
    build=flat,
    vision=False,
    sized=_qwen3_config,
)
