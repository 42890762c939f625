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


@dataclass(frozen=True)
class Family:
    """A tiny model of one mlx-vlm family.

    Attributes:
        model_type: mlx-vlm's name for the family (``config.json``'s), and
            of its module, ``mlx_vlm.models.<model_type>``.
        specials: Its special tokens, in id order.
        config: ``config.json``.
        files: Every other JSON file but ``tokenizer.json``.
        build: Builds the model class from the module and the config (for
            its shapes).
        embeddings: Parameters whose rows of special tokens and lone high
            bytes are zero: tied, their logits are zero, below the best of
            the other random logits, so greedy decoding never picks a special
            token (no early end of turn) nor a byte that alone is invalid
            UTF-8 (some detokenizers refuse it).
        vision: Whether it takes images (:func:`make_tiny_vlm` writes it)
            or not (:func:`make_tiny_lm`).
        marked: Whether the marker names the family (the first family's
            marker predates the others, and stays as it was).
        name: The name it is asked for by, where several families share a
            model class (a tool-format family on Llama's): the marker names
            it too. Empty: the family is asked for by ``model_type``.
        tokenizer: Writes ``tokenizer.json`` from the special tokens (the
            shared byte-level BPE, or a family's own dress of it).
        generator: The function that writes it, for the marker (empty:
            ``make_tiny_vlm`` or ``make_tiny_lm``, by ``vision``).
    """

    model_type: str
    specials: tuple[str, ...]
    config: Callable[[], dict[str, Any]]
    files: Callable[[], dict[str, Any]]
    build: Callable[[Any, dict[str, Any]], Any] = nested
    embeddings: tuple[str, ...] = ("language_model.model.embed_tokens.weight",)
    vision: bool = True
    marked: bool = True
    name: str = ""
    tokenizer: Callable[[tuple[str, ...]], bytes] = tokenizer_json
    generator: str = ""

    @property
    def key(self) -> str:
        """The name :func:`make_tiny_lm` and friends know it by."""
        return self.name or self.model_type

    def marker(self, seed: int, sizes: dict[str, int]) -> dict[str, Any]:
        marker = {
            "format": FORMAT,
            "generator": "mlx_pinned.testing."
            + (self.generator or "make_tiny_" + ("vlm" if self.vision else "lm")),
            "mlx_vlm": _mlx_vlm_version(),
            "seed": seed,
            "files": sizes,
        }
        if self.marked:
            marker["model_type"] = self.model_type
        if self.name:
            marker["family"] = self.name
        return marker

    def write(self, folder: pathlib.Path, seed: int) -> None:
        """Write every file of the model into ``folder`` (not the marker)."""
        files = {"config.json": self.config(), **self.files()}
        data = {name: to_json(value) for name, value in files.items()}
        data["tokenizer.json"] = self.tokenizer(self.specials)
        for name, content in data.items():
            (folder / name).write_bytes(content)
        hidden = [*range(len(self.specials)), *high_byte_ids(self.specials)]
        write_weights(
            folder / "model.safetensors",
            seed,
            parameter_specs(
                f"mlx_vlm.models.{self.model_type}",
                lambda module: self.build(module, self.config()),
                kind=self.build.__name__,
            ),
            dict.fromkeys(self.embeddings, hidden),
        )


@dataclass(frozen=True)
class SpeechFamily(Family):
    """A family of mlx-audio's: its model class in ``module``, built by
    ``build`` from the config; ``tokenizer`` may give no bytes (a family
    whose vocabulary is in its config) and ``adjust`` touches the drawn
    weights (name and value in, value out)."""

    module: str = ""
    adjust: Callable[[str, Any], Any] | None = None

    def write(self, folder: pathlib.Path, seed: int) -> None:
        files = {"config.json": self.config(), **self.files()}
        for name, value in files.items():
            (folder / name).write_bytes(to_json(value))
        tokenizer = self.tokenizer(self.specials)
        if tokenizer:
            (folder / "tokenizer.json").write_bytes(tokenizer)
        specs = parameter_specs(
            self.module, lambda module: self.build(module, self.config())
        )
        write_weights(folder / "model.safetensors", seed, specs, {}, self.adjust)


def _mlx_vlm_version() -> str:
    try:
        return metadata.version("mlx-vlm")
    except metadata.PackageNotFoundError:
        return "unknown"
