"""What a tiny model family is made of, and writing one into a folder.

Calling thread; see :mod:`._weights` for the one model build per family.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Final

from ._install import to_json
from ._tokenizer import high_byte_ids, tokenizer_json
from ._weights import parameter_specs, write_weights

# Bump when the files written change, so cached folders are rebuilt.
FORMAT: Final = 4


@dataclass(frozen=True)
class Family:
    """A tiny model of one mlx-vlm family.

    Attributes:
        model_type: mlx-vlm's name for the family (``config.json``'s).
        module: The mlx-vlm module of its model class.
        specials: Its special tokens, in id order.
        files: Every JSON file but the weights and ``tokenizer.json``.
        build: Builds the model class from the module (for its shapes).
        embeddings: Parameters whose rows of special tokens and lone high
            bytes are zero: tied, their logits are zero, below the best of
            the other random logits, so greedy decoding never picks a special
            token (no early end of turn) nor a byte that alone is invalid
            UTF-8 (some detokenizers refuse it).
        vision: Whether it takes images.
        generator: The public function that writes it (in its marker).
        marked: Whether the marker names the family (the first family's
            marker predates the others, and stays as it was).
    """

    model_type: str
    module: str
    specials: tuple[str, ...]
    files: Callable[[], dict[str, Any]]
    build: Callable[[Any], Any]
    embeddings: tuple[str, ...] = ("language_model.model.embed_tokens.weight",)
    vision: bool = True
    generator: str = "mlx_pinned.testing.make_tiny_vlm"
    marked: bool = True

    def marker(self, seed: int, sizes: dict[str, int]) -> dict[str, Any]:
        marker = {
            "format": FORMAT,
            "generator": self.generator,
            "mlx_vlm": _mlx_vlm_version(),
            "seed": seed,
            "files": sizes,
        }
        if self.marked:
            marker["model_type"] = self.model_type
        return marker

    def write(self, folder: pathlib.Path, seed: int) -> None:
        """Write every file of the model into ``folder`` (not the marker)."""
        files = {name: to_json(value) for name, value in self.files().items()}
        files["tokenizer.json"] = tokenizer_json(self.specials)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        hidden = [*range(len(self.specials)), *high_byte_ids(self.specials)]
        write_weights(
            folder / "model.safetensors",
            seed,
            parameter_specs(self.module, self.build),
            dict.fromkeys(self.embeddings, hidden),
        )


def ids(specials: tuple[str, ...]) -> dict[str, int]:
    """Token ids of the special tokens (the trainer gives them the first)."""
    return {token: index for index, token in enumerate(specials)}


def nested(module: Any, config: dict[str, Any]) -> Any:
    """Build a family with a text and a vision config from ``config``."""
    config = dict(config)
    # mlx-vlm 0.4.x keeps nested configs as dicts; 0.7.x converts them itself.
    config["text_config"] = module.TextConfig.from_dict(config["text_config"])
    config["vision_config"] = module.VisionConfig.from_dict(config["vision_config"])
    return module.Model(module.ModelConfig.from_dict(config))


def flat(module: Any, config: dict[str, Any]) -> Any:
    """Build a text-only family from ``config``."""
    return module.Model(module.ModelConfig.from_dict(dict(config)))


def siglip_tower(side: int, patch: int) -> dict[str, Any]:
    """A 2-layer, 32-wide SigLIP vision tower for ``side``-pixel images
    (Gemma 3, SmolVLM and Aya Vision use one)."""
    return {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": patch,
        "image_size": side,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }


def _mlx_vlm_version() -> str:
    try:
        return metadata.version("mlx-vlm")
    except metadata.PackageNotFoundError:
        return "unknown"
