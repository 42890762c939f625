"""Gemma 3: a SigLIP tower, pooled 2x2, before a Gemma 3 decoder with
sliding-window layers. Calling thread.

Its tokenizer holds Gemma's special tokens, Gemma 3's image tokens
(``<start_of_image>``, ``<image_soft_token>``) and ``<image>``.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import (
    SIGLIP_SIDE,
    SIGLIP_TOKENS,
    TINY,
    Size,
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
_CHAT_TEMPLATE: Final = template(
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
    "{%- if loop.first -%}{{- first_user_prefix -}}{%- endif -%}",
    content("<start_of_image>", strings=True, trim=True),
    "{{- '<end_of_turn>\\n' -}}{%- endfor -%}",
    generation_prompt("<start_of_turn>model\\n"),
)


def _config(size: Size = TINY) -> dict[str, Any]:
    text = decoder(
        "gemma3_text",
        size=size,
        query_pre_attn_scalar=size.head_dim,
        rms_norm_eps=1e-6,
        rope_global_base_freq=1000000.0,
        rope_local_base_freq=10000.0,
        # Five layers slide to one that attends to everything, as Gemma 3's
        # (tiny: layer 0 slides, layer 1 does not).
        sliding_window=size.window,
        sliding_window_pattern=min(size.layers, 6),
        mm_tokens_per_image=SIGLIP_TOKENS,
        max_position_embeddings=32768,
    )
    return vision_model(
        "Gemma3ForConditionalGeneration",
        "gemma3",
        text,
        # An image is one SigLIP input, pooled 2x2 to its soft tokens.
        siglip_tower(size),
        size,
        boi_token_index=_IDS["<start_of_image>"],
        eoi_token_index=_IDS["<end_of_image>"],
        image_token_index=_IDS["<image_soft_token>"],
        mm_tokens_per_image=SIGLIP_TOKENS,
        hidden_size=size.hidden,
        pad_token_id=_IDS["<pad>"],
        eos_token_id=[_IDS["<eos>"], _IDS["<end_of_turn>"]],
    )


def _files() -> dict[str, Any]:
    image = {
        "size": {"height": SIGLIP_SIDE, "width": SIGLIP_SIDE},
        "resample": 2,
        "do_resize": True,
        "do_pan_and_scan": False,
    }
    return {
        **token_files(
            SPECIAL_TOKENS,
            _CHAT_TEMPLATE,
            bos="<bos>",
            eos="<eos>",
            pad="<pad>",
            stops=("<end_of_turn>",),
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        ),
        **processor_files(
            "Gemma3ImageProcessor",
            "Gemma3Processor",
            image,
            image_seq_length=SIGLIP_TOKENS,
        ),
    }


GEMMA3: Final = Family("gemma3", SPECIAL_TOKENS, _config, _files, sized=_config)
