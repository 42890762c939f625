"""Qwen3.5: a hybrid decoder (gated delta-net linear attention in most
layers, with a recurrent state per row instead of a KV cache, full
attention with partial interleaved multimodal RoPE in the others) after a
Qwen3-VL style vision tower without deepstack. Calling thread.

It shares the Qwen tokenizer, template and processor files of
:mod:`._qwen`.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import vision_model
from ._family import Family
from ._qwen import (
    SPECIAL_TOKENS,
    qwen3_vision_config,
    qwen3_vl_files,
    qwen_media,
    qwen_text_config,
)


def _config() -> dict[str, Any]:
    text = qwen_text_config(
        "qwen3_5_text",
        # Layer 0 linear (gated delta-net), layer 1 full attention.
        full_attention_interval=2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        attention_bias=False,
        # Half of each 16-wide head rotates: 4 frequency pairs, sectioned
        # 2 temporal, 1 height, 1 width, interleaved.
        rope_parameters={
            "type": "default",
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    return vision_model(
        "Qwen3_5ForConditionalGeneration",
        "qwen3_5",
        text,
        qwen3_vision_config("qwen3_5", deepstack=[]),
        **qwen_media(),
    )


QWEN3_5: Final = Family("qwen3_5", SPECIAL_TOKENS, _config, qwen3_vl_files)
