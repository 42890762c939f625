"""Gemma 4: a Gemma 4 decoder with a ViT vision tower and a Conformer audio
tower (USM's log-mel features, 40 ms a soft token), the omni family that
takes ``input_audio`` parts. Calling thread.

Its tokenizer holds Gemma's special tokens, Gemma 4's turn markers
(``<|turn>``, ``<turn|>``) and its media tokens: an image is
``<|image>`` + ``<|image|>`` soft tokens + ``<image|>``, an audio file
``<|audio>`` + ``<|audio|>`` soft tokens + ``<audio|>`` (mlx-vlm's own
processor expands each placeholder by the file's length).

The tiny model's two decoder layers attend to everything: a model whose
layers all keep plain KV caches takes part in the server's prompt cache,
which the audio keys by content. The bench model interleaves sliding-window
layers, five to one, as the real checkpoints do.
"""

from __future__ import annotations

from typing import Any, Final

from ._configs import TINY, Size, decoder, token_files, vision_model
from ._family import Family
from ._templates import generation_prompt, template
from ._tokenizer import ids

SPECIAL_TOKENS: Final = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
)

_IDS: Final = ids(SPECIAL_TOKENS)

# The soft tokens an image becomes (the tower pools 2x2 patches of 16 px).
_IMAGE_TOKENS: Final = 4
_POOLING: Final = 2
_PATCH: Final = 16

# Gemma 4's layout: turns between <|turn>role and <turn|>, the assistant is
# "model", a system turn of its own; an image part is <|image|>, an audio
# part <|audio|>, each in place.
_CHAT_TEMPLATE: Final = template(
    "{{- bos_token -}}",
    "{%- for message in messages -%}",
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}",
    "{{- '<|turn>' + role + '\\n' -}}",
    "{%- if message['content'] is string -%}",
    "{{- message['content'] | trim -}}",
    "{%- elif message['content'] is not none -%}",
    "{%- for part in message['content'] -%}",
    "{%- if part.get('type', '') in ('image', 'image_url') -%}",
    "{{- '<|image|>' -}}",
    "{%- elif part.get('type', '') in ('audio', 'input_audio') -%}",
    "{{- '<|audio|>' -}}",
    "{%- elif 'text' in part -%}",
    "{{- part['text'] | trim -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- endif -%}",
    "{{- '<turn|>\\n' -}}{%- endfor -%}",
    generation_prompt("<|turn>model\\n"),
)


def _layer_types(size: Size) -> list[str]:
    """Tiny: every layer attends to everything (see above). Bench: the layers
    slide but the last."""
    if size == TINY:
        return ["full_attention"] * size.layers
    return ["sliding_attention"] * (size.layers - 1) + ["full_attention"]


def _config(size: Size = TINY) -> dict[str, Any]:
    text = decoder(
        "gemma4_text",
        size=size,
        global_head_dim=size.head_dim,
        rms_norm_eps=1e-6,
        layer_types=_layer_types(size),
        sliding_window=512,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": size.tower_hidden,
        "intermediate_size": size.tower_intermediate,
        "num_hidden_layers": size.tower_layers,
        "num_attention_heads": size.tower_heads,
        "num_key_value_heads": size.tower_heads,
        "head_dim": size.tower_hidden // size.tower_heads,
        "global_head_dim": size.tower_hidden // size.tower_heads,
        "patch_size": _PATCH,
        "position_embedding_size": 64,
        "pooling_kernel_size": _POOLING,
        "default_output_length": _IMAGE_TOKENS,
    }
    audio = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "subsampling_conv_channels": [8, 4],
        "conv_kernel_size": 5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "output_proj_dims": 32,
        # Random clip bounds would clip every activation to one value.
        "use_clipped_linears": False,
    }
    config = vision_model(
        "Gemma4ForConditionalGeneration",
        "gemma4",
        text,
        vision,
        size,
        audio_config=audio,
        image_token_id=_IDS["<|image|>"],
        audio_token_id=_IDS["<|audio|>"],
        video_token_id=_IDS["<|video|>"],
        boi_token_id=_IDS["<|image>"],
        eoi_token_id=_IDS["<image|>"],
        boa_token_id=_IDS["<|audio>"],
        eoa_token_id=_IDS["<audio|>"],
        hidden_size=size.hidden,
        pad_token_id=_IDS["<pad>"],
        eos_token_id=[_IDS["<eos>"], _IDS["<turn|>"]],
        vision_soft_tokens_per_image=_IMAGE_TOKENS,
    )
    return config


def _files() -> dict[str, Any]:
    return {
        **token_files(
            SPECIAL_TOKENS,
            _CHAT_TEMPLATE,
            bos="<bos>",
            eos="<eos>",
            pad="<pad>",
            stops=("<turn|>",),
            extra_special_tokens={
                "boi_token": "<|image>",
                "eoi_token": "<image|>",
                "image_token": "<|image|>",
                "boa_token": "<|audio>",
                "eoa_token": "<audio|>",
                "audio_token": "<|audio|>",
            },
        ),
        # mlx-vlm's own Gemma 4 processor reads this one file. Its audio
        # feature extractor: USM's 16 kHz, 128 mels, 10 ms hops; FFT overdrive
        # (Gemma 3n's) so that no mel filter is empty (a warning otherwise).
        "processor_config.json": {
            "processor_class": "Gemma4Processor",
            "image_processor": {
                "image_processor_type": "Gemma4ImageProcessor",
                "patch_size": _PATCH,
                "max_soft_tokens": _IMAGE_TOKENS,
                "pooling_kernel_size": _POOLING,
            },
            "feature_extractor": {
                "feature_extractor_type": "Gemma4AudioFeatureExtractor",
                "fft_overdrive": True,
            },
            "audio_seq_length": 750,
            "audio_ms_per_token": 40,
        },
    }


def _build(module: Any, config: dict[str, Any]) -> Any:
    config = dict(config)
    config["text_config"] = module.TextConfig.from_dict(config["text_config"])
    config["vision_config"] = module.VisionConfig.from_dict(config["vision_config"])
    config["audio_config"] = module.AudioConfig.from_dict(config["audio_config"])
    return module.Model(module.ModelConfig.from_dict(config))


GEMMA4: Final = Family(
    "gemma4",
    SPECIAL_TOKENS,
    _config,
    _files,
    build=_build,
    generator="make_tiny_omni",
    sized=_config,
)
