"""Qwen3.5: a hybrid decoder (gated delta-net linear attention in most
layers, with a recurrent state per row instead of a KV cache, full
attention with partial interleaved multimodal RoPE in the others) after a
Qwen3-VL style vision tower without deepstack. Calling thread.

It shares the Qwen tokenizer, template and processor files of
:mod:`._qwen`.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import TINY, Size, vision_model
from ._family import Family
from ._qwen import (
    SPECIAL_TOKENS,
    mrope_section,
    qwen3_vision_config,
    qwen3_vl_files,
    qwen_media,
    qwen_text_config,
)


def _config(size: Size = TINY) -> dict[str, Any]:
    text = qwen_text_config(
        "qwen3_5_text",
        size,
        # Tiny: layer 0 linear (gated delta-net), layer 1 full attention.
        # Bench: three linear layers to one full, as Qwen3.5's.
        full_attention_interval=min(size.layers, 4),
        linear_num_value_heads=size.heads,
        linear_num_key_heads=size.kv_heads,
        linear_key_head_dim=size.head_dim,
        linear_value_head_dim=size.head_dim,
        linear_conv_kernel_dim=4,
        attention_bias=False,
        # Half of each head rotates, sectioned temporal, height, width,
        # interleaved.
        rope_parameters={
            "type": "default",
            "mrope_section": mrope_section(size.head_dim // 2),
            "mrope_interleaved": True,
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    return vision_model(
        "Qwen3_5ForConditionalGeneration",
        "qwen3_5",
        text,
        qwen3_vision_config("qwen3_5", deepstack=[], size=size),
        size,
        **qwen_media(),
    )


QWEN3_5: Final = Family(
    "qwen3_5", SPECIAL_TOKENS, _config, qwen3_vl_files, sized=_config
)
