"""What a model family is made of, and writing one into a folder at a size.

Calling thread; see :mod:`._weights` for the one model build per family.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, Final

from ._configs import TINY, Size
from ._install import to_json
from ._tokenizer import high_byte_ids, padded, tokenizer_json
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
    """A model of one mlx-vlm family, tiny unless :meth:`at` another size.

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
            ``make_<size>_vlm`` or ``make_<size>_lm``, by ``vision``).
        sized: Its config at any size, where it has a bench model too.
        size: The size ``config`` is at.
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
    sized: Callable[[Size], dict[str, Any]] | None = None
    size: Size = TINY

    def at(self, size: Size) -> Family:
        """The family at ``size``, written by ``make_<size>_vlm`` or ``_lm``.

        Raises:
            ValueError: It has no config but the tiny one.
        """
        if self.sized is None:
            raise ValueError(f"{self.key} is written at the tiny size only.")
        config = functools.partial(self.sized, size)
        return replace(self, config=config, size=size, marked=True, generator="")

    @property
    def key(self) -> str:
        """The name :func:`make_tiny_lm` and friends know it by."""
        return self.name or self.model_type

    def marker(self, seed: int, sizes: dict[str, int]) -> dict[str, Any]:
        marker = {
            "format": FORMAT,
            "generator": "mlx_pinned.testing."
            + (
                self.generator
                or f"make_{self.size.name}_" + ("vlm" if self.vision else "lm")
            ),
            "mlx_vlm": _mlx_vlm_version(),
            "seed": seed,
            "files": sizes,
        }
        if self.size != TINY:
            marker["size"] = self.size.name
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
        if self.size.vocab > TINY.vocab:
            data["tokenizer.json"] = padded(data["tokenizer.json"], self.size.vocab)
        for name, content in data.items():
            (folder / name).write_bytes(content)
        hidden = [*range(len(self.specials)), *high_byte_ids(self.specials)]
        write_weights(
            folder / "model.safetensors",
            seed,
            parameter_specs(
                f"mlx_vlm.models.{self.model_type}",
                lambda module: self.build(module, self.config()),
                kind=f"{self.build.__name__}/{self.size.name}",
            ),
            dict.fromkeys(self.embeddings, hidden),
            dtype=self.size.dtype,
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
