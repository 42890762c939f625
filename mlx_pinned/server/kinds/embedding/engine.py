"""An embedding model's engine: mlx-vlm's embedding loader, its inputs
padded into forward passes that every waiting request shares. Loading and
every pass run on the MLX thread; :meth:`EmbeddingEngine.embed` is called on
the event loop."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import mlx.core as mx
import numpy as np

from ...engine.passes import (
    Encoded,
    PassEngine,
    input_limit,
    padded,
)
from ...failures import ImagesUnsupportedError, PromptError, PromptTooLongError
from .values import EmbeddingFacts, EmbeddingParams, Embeddings, ImageInput

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread

    from ...config import ModelSettings

__all__ = ["IMAGE_TURN", "EmbeddingEngine", "LoadedEmbedder", "load_embedder"]

logger = logging.getLogger("mlx_pinned.server")


@dataclass(eq=False)
class LoadedEmbedder:
    """An embedding model loaded and evaluated on the MLX thread: mlx-vlm's
    ``model`` (its ``text_embeds`` pooled and normalised as its checkpoint
    says), its ``processor`` (the tokenizer alone for a text model) and the
    ``pad_id`` that padding is made of (masked out)."""

    model: Any
    processor: Any
    tokenizer: Any
    path: str
    vocab_size: int
    max_input_tokens: int
    width: int
    matryoshka_dimensions: tuple[int, ...] | None
    pad_id: int
    weight_bytes: int
    loaded_at: float = field(default_factory=time.time)

    def tokenize(
        self, numbered: Sequence[tuple[int, str | tuple[int, ...]]]
    ) -> list[Encoded]:
        """Each input's tokens (a text's with its special tokens), ``numbered``
        by its index in the request, which the errors name. MLX thread."""
        inputs = [item for _, item in numbered]
        texts = [
            (index, text) for index, text in enumerate(inputs) if isinstance(text, str)
        ]
        tokens: list[list[int]] = [
            [] if isinstance(item, str) else list(item) for item in inputs
        ]
        if texts:
            encoded = self.tokenizer([text for _, text in texts])["input_ids"]
            for (index, _), ids in zip(texts, encoded, strict=True):
                tokens[index] = list(ids)
        for (index, _), ids in zip(numbered, tokens, strict=True):
            if not ids:
                raise PromptError(
                    f"Invalid value for 'input': input {index} has no tokens; "
                    "send text that has some.",
                    "invalid_value",
                )
            if len(ids) > self.max_input_tokens:
                raise PromptTooLongError(
                    f"Invalid value for 'input': input {index} has {len(ids)} "
                    f"tokens, more than this model's {self.max_input_tokens}.",
                    len(ids),
                    self.max_input_tokens,
                )
        return [Encoded(ids) for ids in tokens]

    @property
    def accepts_images(self) -> bool:
        """Whether it embeds images: its processor has an image processor,
        and a chat template to place them with."""
        processor = getattr(self.processor, "image_processor", None)
        return processor is not None and self.has_chat_template

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray:
        """The vectors of ``batch``, padded on the right and masked; float32,
        one row per input. MLX thread."""
        ids, mask, _ = padded(batch, self.pad_id)
        _forget_positions(self.model)
        out = self.model(mx.array(ids), attention_mask=mx.array(mask))
        vectors = out.text_embeds.astype(mx.float32)
        mx.eval(vectors)
        return np.array(vectors, copy=True)

    def conversation(
        self,
        messages: Sequence[dict[str, Any]],
        images: Sequence[Image.Image],
        add_generation_prompt: bool,
    ) -> tuple[np.ndarray, int]:
        """One vector for the conversation (rendered with the chat template,
        run alone through the processor) and its tokens. MLX thread."""
        from mlx_vlm.prompt_utils import get_chat_template
        from mlx_vlm.utils import prepare_inputs

        if images and not self.accepts_images:
            raise ImagesUnsupportedError
        prompt = get_chat_template(
            self.processor, list(messages), add_generation_prompt=add_generation_prompt
        )
        inputs = prepare_inputs(  # type: ignore[no-untyped-call]
            self.processor,
            images=list(images) or None,
            prompts=prompt,
            image_token_index=getattr(self.model.config, "image_token_index", None),
        )
        tokens = int(inputs["attention_mask"].sum().item())
        if tokens > self.max_input_tokens:
            raise PromptTooLongError(
                f"Invalid value for 'messages': the conversation has {tokens} "
                f"tokens, more than this model's {self.max_input_tokens}.",
                tokens,
                self.max_input_tokens,
            )
        _forget_positions(self.model)
        out = self.model(**inputs)
        vector = out.text_embeds[0].astype(mx.float32)
        mx.eval(vector)
        return np.array(vector, copy=True), tokens


def _forget_positions(model: Any) -> None:
    """Drop the positions a Qwen-VL model keeps from its last call, which its
    forward reuses for any input no longer than the last."""
    language: Any = getattr(model, "language_model", None)
    if hasattr(language, "_position_ids"):
        language._position_ids = None
        language._rope_deltas = None


def load_embedder(model_path: str | Path) -> LoadedEmbedder:
    """Load an embedding model with mlx-vlm's loader (pooling as its
    ``1_Pooling/config.json`` says) and evaluate it. MLX thread."""
    from mlx.utils import tree_flatten
    from mlx_vlm.embedding_loader import load_embedding_model
    from mlx_vlm.models.pooling import read_pooling_config
    from mlx_vlm.utils import get_model_path, load_config, load_processor

    folder = Path(get_model_path(str(model_path)))
    model = load_embedding_model(folder)
    model.pooling_config = read_pooling_config(folder)  # type: ignore[no-untyped-call]
    processor = load_processor(folder, add_detokenizer=False)
    tokenizer: Any = getattr(processor, "tokenizer", processor)
    config = load_config(folder)
    text = config.get("text_config") or config
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    # The width: one pass of one token (what the model says, not its config).
    probe = model(mx.array([[0]]), attention_mask=mx.array([[1]])).text_embeds
    mx.eval(probe)
    if probe.ndim != 2:
        raise ValueError(
            f"{model_path} gives a vector per token (a late-interaction model); "
            "/v1/embeddings serves models that give one vector per input"
        )
    pad = getattr(tokenizer, "pad_token_id", None)
    loaded = LoadedEmbedder(
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        path=str(model_path),
        vocab_size=int(text.get("vocab_size") or len(tokenizer)),
        max_input_tokens=input_limit(config, tokenizer),
        width=int(probe.shape[-1]),
        matryoshka_dimensions=_matryoshka(config),
        pad_id=int(pad) if pad is not None else 0,
        weight_bytes=sum(value.nbytes for _, value in flat),
    )
    logger.info(
        "loaded embedding model %s: %d values a vector, inputs up to %d tokens",
        model_path,
        loaded.width,
        loaded.max_input_tokens,
    )
    return loaded


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    """The widths a checkpoint says it was trained to be cut to (vLLM reads
    the same keys): ``matryoshka_dimensions``, or any with ``is_matryoshka``."""
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return tuple(sorted(dims))
    return () if config.get("is_matryoshka") else None


class EmbeddingEngine(PassEngine[LoadedEmbedder]):
    """One model's :class:`~.values.EmbeddingEngine`."""

    @classmethod
    def load(cls, settings: ModelSettings, thread: MLXThread) -> EmbeddingEngine:
        """MLX thread; a pass takes about ``prefill_step_seconds``."""
        loaded = load_embedder(settings.path)
        return cls(loaded, thread, seconds=settings.prefill_step_seconds)

    def __init__(self, loaded: LoadedEmbedder, thread: MLXThread, **passes: Any):
        super().__init__(loaded, thread, **passes)
        self.facts = EmbeddingFacts(
            loaded.vocab_size,
            loaded.max_input_tokens,
            loaded.width,
            loaded.matryoshka_dimensions,
            loaded.accepts_images,
            loaded.has_chat_template,
        )

    async def embed(
        self, params: EmbeddingParams, images: Sequence[Image.Image] = ()
    ) -> Embeddings:
        if params.messages:
            # A job of its own: one pass, never padded beside other inputs.
            vector, tokens = await self.thread.run(
                self.loaded.conversation,
                params.messages,
                images,
                params.add_generation_prompt,
            )
            return Embeddings((_encoded(vector, params.dimensions),), tokens)
        numbered = [
            (index, item)
            for index, item in enumerate(params.inputs)
            if not isinstance(item, ImageInput)
        ]
        inputs = await self.tokenized(self.loaded.tokenize, numbered)
        rows = await self.driver.rows(inputs)
        vectors = dict(zip((index for index, _ in numbered), rows, strict=True))
        tokens = sum(len(item.ids) for item in inputs)
        for index, item in enumerate(params.inputs):
            if isinstance(item, ImageInput):
                # A job per image: the thread's other work runs between.
                image = [images[item.image]]
                vectors[index], used = await self.thread.run(
                    self.loaded.conversation, IMAGE_TURN, image, True
                )
                tokens += used
        ordered = (vectors[index] for index in range(len(params.inputs)))
        return Embeddings(
            tuple(_encoded(row, params.dimensions) for row in ordered), tokens
        )


#: The conversation an image input is embedded as: one user turn that holds
#: it, the generation prompt added (mlx-vlm's server's ``_embed_image``).
IMAGE_TURN: Final = ({"role": "user", "content": [{"type": "image"}]},)


def _encoded(vector: np.ndarray, dimensions: int | None) -> bytes:
    """``vector`` cut to ``dimensions`` and normalised again (the model's
    are unit length), as little-endian float32 bytes."""
    if dimensions is not None and dimensions < vector.shape[-1]:
        vector = vector[:dimensions]
        norm = float(np.linalg.norm(vector))
        vector = vector / max(norm, 1e-12) if math.isfinite(norm) else vector
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()
