"""Llama, text only: Llama 3's special tokens plus ``<image>``, and a
Llama 3 style chat template. Calling thread.
"""

from __future__ import annotations

import functools
from typing import Any, Final

from ._configs import tied_decoder, token_files
from ._family import Family, flat
from ._templates import content, generation_prompt, template

SPECIAL_TOKENS: Final = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
)

# Llama 3's layout; content is a string or typed parts, an image part
# becoming LLaVA's <image> placeholder (the processor expands it).
CHAT_TEMPLATE: Final = template(
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}",
    content("<image>\\n", strings=True),
    "{{- '<|eot_id|>' -}}{%- endfor -%}",
    generation_prompt("<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
)


@functools.cache
def _config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        **tied_decoder(
            "llama",
            SPECIAL_TOKENS,
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    }


def _files() -> dict[str, Any]:
    return token_files(
        SPECIAL_TOKENS,
        CHAT_TEMPLATE,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        stops=("<|end_of_text|>",),
    )


LLAMA: Final = Family(
    "llama", SPECIAL_TOKENS, _config, _files, build=flat, vision=False
)
