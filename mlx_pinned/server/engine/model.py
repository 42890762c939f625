"""A model loaded for serving (:func:`load`: mlx-vlm's, evaluated whole) and
what the server reads of it (:class:`LoadedModel`). MLX thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ..limits import context_length, longest_token_chars
from ..media import AudioInput

if TYPE_CHECKING:
    from ..events import Grammar
    from .logits import GrammarMatcher

__all__ = ["EXACT_FAMILIES", "LoadedModel", "load", "serial_reason"]

# Families whose rows the batch engine computes exactly as each alone
# (tests/server/test_families.py runs every one against mlx-vlm's own loop).
# Any other family is served one generation at a time.
EXACT_FAMILIES = frozenset(
    {
        "qwen3_vl",
        "qwen2_5_vl",
        "qwen3_5",
        "gemma3",
        "gemma4",
        "smolvlm",
        "mistral3",
        "aya_vision",
        "qwen3",
        "llama",
    }
)

logger = logging.getLogger("mlx_pinned.server")


@dataclass(eq=False)
class LoadedModel:
    """A model, its processor and config, loaded and evaluated on the MLX
    thread. ``loaded_at``: when the load ended (Unix time); ``weight_bytes``:
    its parameters' bytes, as loaded (the memory budget counts these)."""

    model: Any
    processor: Any
    path: str
    load_seconds: float
    parameters: int
    loaded_at: float = field(default_factory=time.time)  # Unix time, at the end
    weight_bytes: int = 0
    grammar_tokenizer: Any = None  # llguidance's, made on first use
    # A fresh matcher per grammar, to copy: see .logits.new_matcher.
    grammar_matchers: dict[Grammar, GrammarMatcher] = field(default_factory=dict)
    _token_text: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    _longest_token: int | None = None

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def context_length(self) -> int | None:
        """In tokens, from its config (None: it says none)."""
        return context_length(self.config)

    @property
    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token (computed once)."""
        if self._longest_token is None:
            self._longest_token = longest_token_chars(self.tokenizer)
        return self._longest_token

    @property
    def chat_template(self) -> str | None:
        for owner in (self.processor, getattr(self.processor, "tokenizer", None)):
            template = getattr(owner, "chat_template", None)
            if isinstance(template, str) and template:
                return template
        return None

    @property
    def batches_exactly(self) -> bool:
        return self.serial_reason is None

    @property
    def serial_reason(self) -> str | None:
        """Why the batch engine serves it one generation at a time; None when its
        rows may be batched."""
        return serial_reason(self.config)

    @property
    def accepts_images(self) -> bool:
        """A vision config and an image processor (a text-only model has neither)."""
        return (
            getattr(self.config, "vision_config", None) is not None
            and getattr(self.processor, "image_processor", None) is not None
        )

    @property
    def audio_input(self) -> AudioInput | None:
        """How the model takes audio, where it has an audio config, an audio token
        and a feature extractor (an omni model: Gemma 4's), files as long as its
        processor caps them; None for a model that takes no audio."""
        config, processor = self.config, self.processor
        extractor = getattr(processor, "feature_extractor", None)
        rate = getattr(extractor, "sampling_rate", None)
        if (
            getattr(config, "audio_config", None) is None
            or not isinstance(getattr(config, "audio_token_id", None), int)
            or not isinstance(rate, int)
        ):
            return None
        tokens = getattr(processor, "audio_seq_length", None)
        milliseconds = getattr(processor, "audio_ms_per_token", None)
        if not isinstance(tokens, int) or not isinstance(milliseconds, int | float):
            return AudioInput(rate)
        return AudioInput(rate, tokens * milliseconds / 1000)

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output: valid token ids are below it."""
        config = self.config
        text_config = getattr(config, "text_config", None)
        size = getattr(text_config, "vocab_size", None) or getattr(
            config, "vocab_size", None
        )
        return int(size) if size else len(self.tokenizer)

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and UTF-8 bytes, as OpenAI's logprobs show them: a
        byte-level BPE token's partial character as ``\\xNN`` in its text."""
        cached = self._token_text.get(token_id)
        if cached is None:
            raw = token_bytes(self.processor, self.tokenizer, token_id)
            cached = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
            self._token_text[token_id] = cached
        return cached


def serial_reason(config: Any) -> str | None:
    """Why the batch engine cannot batch a model of ``config`` exactly, or None:
    a family not in :data:`EXACT_FAMILIES`, or a variant whose rows would
    read each other's state."""
    model_type = getattr(config, "model_type", None)
    if model_type not in EXACT_FAMILIES:
        return f"the batch engine is not proven exact on the {model_type} family"
    text = getattr(config, "text_config", None)
    if model_type == "mistral3" and getattr(text, "model_type", None) == "ministral3":
        # mlx-vlm's Ministral 3 decoder scales the queries of every row by the
        # position of the batch's first row (a padded row's is negative).
        return (
            "mlx-vlm's Ministral 3 decoder scales every row's attention by the "
            "first row's position, so batched rows would change each other"
        )
    if model_type == "gemma4" and (
        getattr(text, "num_kv_shared_layers", 0)
        or getattr(text, "hidden_size_per_layer_input", 0)
    ):
        # Proven on the tiny Gemma 4 (tests/server/test_input_audio.py), which
        # has neither; the layers that reuse another's KV and the per-layer
        # inputs of the 2B and 4B checkpoints are not.
        return (
            "the batch engine is not proven exact on Gemma 4's shared-KV layers "
            "and per-layer inputs"
        )
    return None


def load(
    model_path: str | Path, *, shard: Callable[[Any], None] | None = None
) -> LoadedModel:
    """Load a model with mlx-vlm and evaluate all of it, lazily built arrays
    included, so none stays tied to another thread's stream; MLX thread.

    Args:
        model_path: A local folder or a Hugging Face hub id.
        shard: Given the model loaded lazily, splits it in place
            (:func:`.shard.shard`): only this rank's part is then read.
    """
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load as vlm_load

    start = time.perf_counter()
    logger.info("loading model %s", model_path)
    model, processor = vlm_load(str(model_path), lazy=shard is not None)
    if shard is not None:
        shard(model)
    mx.eval(model)  # the whole tree, private attributes included
    seconds = time.perf_counter() - start
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    parameters = sum(v.size for _, v in flat)
    loaded = LoadedModel(
        model,
        processor,
        str(model_path),
        seconds,
        parameters,
        weight_bytes=sum(v.nbytes for _, v in flat),
    )
    _ = loaded.longest_token_chars  # once, at load, not in a request
    logger.info(
        "loaded %s (%s, %d parameters) in %.2f s",
        model_path,
        getattr(model.config, "model_type", "?"),
        parameters,
        seconds,
    )
    return loaded


def token_bytes(processor: Any, tokenizer: Any, token_id: int) -> bytes:
    """Through the byte-level BPE map where there is one."""
    detokenizer = getattr(processor, "detokenizer", None)
    byte_decoder = getattr(detokenizer, "_byte_decoder", None)
    if byte_decoder is not None:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(c in byte_decoder for c in piece):
            return bytes(byte_decoder[c] for c in piece)
    return str(tokenizer.decode([token_id])).encode("utf-8")
