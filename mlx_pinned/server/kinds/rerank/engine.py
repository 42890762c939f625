"""A rerank model's engine: a cross-encoder loaded with mlx-vlm's reranker
loader, its (query, document) pairs padded into forward passes that every
waiting request shares. Loading and every pass run on the MLX thread;
:meth:`RerankEngine.score` is called on the event loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from ...engine.passes import (
    Encoded,
    PassEngine,
    input_limit,
    padded,
)
from ...failures import PromptTooLongError
from .values import RerankFacts, RerankParams, Scores

if TYPE_CHECKING:
    from mlx_pinned import MLXThread

    from ...config import ModelSettings

__all__ = ["LoadedReranker", "RerankEngine", "load_reranker"]

logger = logging.getLogger("mlx_pinned.server")


@dataclass(eq=False)
class LoadedReranker:
    """A cross-encoder loaded and evaluated on the MLX thread: mlx-vlm's
    sequence classifier (one logit per pair), its tokenizer (which writes a
    pair with its separators and segment ids), and the ``pad_id`` that
    padding is made of (masked out)."""

    model: Any
    tokenizer: Any
    path: str
    max_input_tokens: int
    pad_id: int
    weight_bytes: int
    loaded_at: float = field(default_factory=time.time)

    def tokenize(self, params: RerankParams) -> list[Encoded]:
        """Each pair's tokens and segments, the document cut at its end to
        fit :attr:`max_input_tokens`. MLX thread."""
        query = len(self.tokenizer(params.query)["input_ids"])
        # The pair adds a separator; leave room for one document token too.
        if query + 2 > self.max_input_tokens:
            raise PromptTooLongError(
                f"Invalid value for 'query': it has {query} tokens, which leaves "
                f"no room for a document in this model's {self.max_input_tokens}.",
                query,
                self.max_input_tokens,
            )
        encoded = self.tokenizer(
            [params.query] * len(params.documents),
            list(params.documents),
            truncation="only_second",
            max_length=self.max_input_tokens,
            return_token_type_ids=True,
        )
        return [
            Encoded(list(ids), list(types))
            for ids, types in zip(
                encoded["input_ids"], encoded["token_type_ids"], strict=True
            )
        ]

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray:
        """The scores of ``batch``, padded on the right and masked; float32,
        one row per pair. MLX thread."""
        ids, mask, types = padded(batch, self.pad_id)
        out = self.model(
            mx.array(ids), attention_mask=mx.array(mask), token_type_ids=mx.array(types)
        )
        scores = mx.sigmoid(out.logits.astype(mx.float32)).reshape(len(batch), 1)
        mx.eval(scores)
        return np.array(scores, copy=True)


def load_reranker(model_path: str | Path) -> LoadedReranker:
    """Load a cross-encoder (a sequence classifier of one label) with
    mlx-vlm's reranker loader and evaluate it. MLX thread."""
    from mlx.utils import tree_flatten
    from mlx_vlm.reranker import RerankerKind, reranker_kind
    from mlx_vlm.reranker_loader import load_sequence_classification_model
    from mlx_vlm.utils import get_model_path, load_config, load_processor

    folder = Path(get_model_path(str(model_path)))
    config = load_config(folder)
    if reranker_kind(config) is not RerankerKind.SEQUENCE_CLASSIFIER:
        raise ValueError(
            f"{model_path} is a generative reranker ({config.get('model_type')}); "
            "this server reranks with cross-encoders (BERT, ModernBERT, XLM-R "
            "sequence classifiers)"
        )
    model = load_sequence_classification_model(folder, config=config)
    processor = load_processor(folder, add_detokenizer=False)
    tokenizer: Any = getattr(processor, "tokenizer", processor)
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    pad = getattr(tokenizer, "pad_token_id", None)
    loaded = LoadedReranker(
        model=model,
        tokenizer=tokenizer,
        path=str(model_path),
        max_input_tokens=input_limit(config, tokenizer),
        pad_id=int(pad) if pad is not None else 0,
        weight_bytes=sum(value.nbytes for _, value in flat),
    )
    logger.info(
        "loaded rerank model %s: pairs up to %d tokens",
        model_path,
        loaded.max_input_tokens,
    )
    return loaded


class RerankEngine(PassEngine[LoadedReranker]):
    """One model's :class:`~.values.RerankEngine`."""

    @classmethod
    def load(cls, settings: ModelSettings, thread: MLXThread) -> RerankEngine:
        """MLX thread; a pass takes about ``prefill_step_seconds``."""
        loaded = load_reranker(settings.path)
        return cls(loaded, thread, seconds=settings.prefill_step_seconds)

    def __init__(self, loaded: LoadedReranker, thread: MLXThread, **passes: Any):
        super().__init__(loaded, thread, **passes)
        self.facts = RerankFacts(loaded.max_input_tokens)

    async def score(self, params: RerankParams) -> Scores:
        def tokenize(documents: Sequence[str]) -> list[Encoded]:
            return self.loaded.tokenize(RerankParams(params.query, tuple(documents)))

        pairs = await self.tokenized(tokenize, params.documents)
        rows = await self.driver.rows(pairs)
        scores = tuple(float(row[0]) for row in rows)
        return Scores(scores, sum(len(pair.ids) for pair in pairs))
