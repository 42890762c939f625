"""Mistral 3: a Pixtral tower (2D RoPE over the patch grid, any aspect
ratio, no fixed size) whose patches are merged 2x2 before a Mistral decoder.
Calling thread.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import decoder, processor_files, token_files, vision_model
from ._family import Family
from ._templates import content, template
from ._tokenizer import ids

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
_CHAT_TEMPLATE: Final = template(
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '[SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST]' -}}"
    "{%- endif -%}",
    content("[IMG]"),
    "{%- if message['role'] == 'system' -%}"
    "{{- '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[/INST]' -}}"
    "{%- else -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}",
)

# Patches of 8 pixels merged 2x2: a token per 16x16 pixels, an image resized
# to 64 pixels on its longer side at most: a 64x64 image is 4 rows of 4.
_PATCH: Final = 8
_LONGEST: Final = 64


def _config() -> dict[str, Any]:
    text = decoder(
        "mistral",
        rms_norm_eps=1e-5,
        rope_theta=1000000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
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
    return vision_model(
        "Mistral3ForConditionalGeneration",
        "mistral3",
        text,
        vision,
        image_token_index=_IDS["[IMG]"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        eos_token_id=[_IDS["</s>"]],
    )


def _files() -> dict[str, Any]:
    image = {
        "size": {"longest_edge": _LONGEST},
        "patch_size": {"height": _PATCH, "width": _PATCH},
        "do_resize": True,
        "resample": 3,
    }
    return {
        **token_files(
            SPECIAL_TOKENS, _CHAT_TEMPLATE, bos="<s>", eos="</s>", pad="<unk>"
        ),
        **processor_files(
            "PixtralImageProcessor",
            "Mistral3Processor",
            image,
            image_token="[IMG]",
            image_break_token="[IMG_BREAK]",
            image_end_token="[IMG_END]",
            patch_size=_PATCH,
            spatial_merge_size=2,
        ),
    }


MISTRAL3: Final = Family("mistral3", SPECIAL_TOKENS, _config, _files)
