"""SmolVLM: a SigLIP tower whose image is split into tiles plus a global
view, pixel-shuffled 2x2, before a Llama decoder. Calling thread.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import (
    SIGLIP_SIDE,
    SIGLIP_TOKENS,
    decoder,
    processor_files,
    siglip_tower,
    token_files,
    vision_model,
)
from ._family import Family
from ._templates import generation_prompt, parts, template
from ._tokenizer import ids

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
_CHAT_TEMPLATE: Final = template(
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
    "{%- endif -%}",
    parts("message['content'] or []", "<image>"),
    "{%- endif -%}{{- '<end_of_utterance>\\n' -}}{%- endfor -%}",
    generation_prompt("Assistant:"),
)


def _config() -> dict[str, Any]:
    text = decoder(
        "llama",
        head_dim=False,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    return vision_model(
        "SmolVLMForConditionalGeneration",
        "smolvlm",
        text,
        siglip_tower(),
        scale_factor=2,
        image_token_id=_IDS["<image>"],
        eos_token_id=[_IDS["<end_of_utterance>"]],
        pad_token_id=_IDS["<|endoftext|>"],
    )


def _files() -> dict[str, Any]:
    # A tile is one SigLIP input; an image is resized to two tiles on its
    # longer side at most, so a 64x64 image is 2x2 tiles and a global view.
    image = {
        "do_resize": True,
        "size": {"longest_edge": 2 * SIGLIP_SIDE},
        "max_image_size": {"longest_edge": SIGLIP_SIDE},
        "do_image_splitting": True,
        "resample": 1,
        "do_pad": True,
    }
    return {
        **token_files(
            SPECIAL_TOKENS,
            _CHAT_TEMPLATE,
            bos="<|im_start|>",
            eos="<end_of_utterance>",
            pad="<|endoftext|>",
            stops=("<|endoftext|>",),
        ),
        **processor_files(
            "SmolVLMImageProcessor",
            "SmolVLMProcessor",
            image,
            image_seq_len=SIGLIP_TOKENS,
        ),
    }


SMOLVLM: Final = Family("smolvlm", SPECIAL_TOKENS, _config, _files)
