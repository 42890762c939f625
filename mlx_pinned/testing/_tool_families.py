"""Text families whose templates and tokenizers carry a tool-call format:
Llama 3.1's JSON, Mistral v3's ``[TOOL_CALLS]`` list, gpt-oss's harmony
and Qwen3-Coder's XML. Calling thread.

Each is mlx-vlm's own class of a family the batch engine is proven exact
on: Llama's for the first three (Mistral 7B's decoder is Llama's; gpt-oss's
mixture of experts with attention sinks has no small stand-in here, so its
tiny family is a Llama decoder with gpt-oss's tokens and template), Qwen3's
for Qwen3-Coder (whose dense shape it is). Only the tokens, the template
and the config's token ids are the family's.
"""

from __future__ import annotations

import functools
from typing import Any, Final

from . import _tool_templates as templates
from ._configs import tied_decoder, token_files
from ._family import Family, flat
from ._qwen import SPECIAL_TOKENS as QWEN_TOKENS
from ._qwen import qwen_text_config

LLAMA3_TOKENS: Final = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)

MISTRAL_TOKENS: Final = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)

HARMONY_TOKENS: Final = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)


def _llama_family(
    name: str,
    specials: tuple[str, ...],
    chat_template: str,
    *,
    bos: str,
    eos: str,
    pad: str,
    stops: tuple[str, ...],
) -> Family:
    @functools.cache
    def config() -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            **tied_decoder(
                "llama",
                specials,
                bos=bos,
                eos=eos,
                rms_norm_eps=1e-5,
                max_position_embeddings=8192,
                rope_theta=500000.0,
            ),
        }

    def files() -> dict[str, Any]:
        return token_files(
            specials, chat_template, bos=bos, eos=eos, pad=pad, stops=stops
        )

    return Family("llama", specials, config, files, build=flat, vision=False, name=name)


LLAMA3_TOOLS: Final = _llama_family(
    "llama3_tools",
    LLAMA3_TOKENS,
    templates.LLAMA3_TOOLS,
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad="<|end_of_text|>",
    stops=("<|end_of_text|>", "<|eom_id|>"),
)

MISTRAL_TOOLS: Final = _llama_family(
    "mistral_tools",
    MISTRAL_TOKENS,
    templates.MISTRAL_TOOLS,
    bos="<s>",
    eos="</s>",
    pad="<unk>",
    stops=(),
)

GPT_OSS_HARMONY: Final = _llama_family(
    "gpt_oss_harmony",
    HARMONY_TOKENS,
    templates.HARMONY,
    bos="<|startoftext|>",
    eos="<|return|>",
    pad="<|endoftext|>",
    stops=("<|endoftext|>", "<|call|>"),
)


@functools.cache
def _qwen3_coder_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        **qwen_text_config("qwen3", rope_theta=1000000.0, attention_bias=False),
    }


def _qwen3_coder_files() -> dict[str, Any]:
    return token_files(
        QWEN_TOKENS,
        templates.QWEN3_CODER,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=("<|endoftext|>",),
    )


QWEN3_CODER: Final = Family(
    "qwen3",
    QWEN_TOKENS,
    _qwen3_coder_config,
    _qwen3_coder_files,
    build=flat,
    vision=False,
    name="qwen3_coder",
)

#: Every tool-format family, in the order :data:`TINY_TOOL_LM_TYPES` lists them.
TOOL_FAMILIES: Final = (LLAMA3_TOOLS, MISTRAL_TOOLS, GPT_OSS_HARMONY, QWEN3_CODER)
