"""Prompts into KV caches for the decode batch: several in one pass
(:func:`prefill_together`, whose logits give their first tokens), or one a
chunk at a time (:class:`ChunkedPrefill`, which leaves a text last token
to the next decode step to run and sample from). MLX thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .checkpoints import Prefix, restore
from .kv_quant import KVQuant, batch_layer, single_caches, to_batch
from .model import LoadedModel
from .model_inputs import MEDIA_TOKENS, Prepared
from .prompt_scores import PromptScores, Scoring
from .quirks import rope_deltas, row_rope_deltas
from .sampling import vlm

# mlx-vlm's default chunk: longer prompts are prefilled alone, in chunks.
PREFILL_STEP = 2048
# Processor outputs a prompt may have and still be prefilled with others.
_BATCHABLE_INPUTS = frozenset({"input_ids", "attention_mask", "pixel_values"})
_BATCHABLE_INPUTS |= {"image_grid_thw"}
# Prefill inputs that matter only for media and rope positions, which a
# decode step of a text token recomputes the same way.
_POSITION_ONLY = frozenset(
    {
        "image_grid_thw",
        "video_grid_thw",
        "position_ids",
        "rope_deltas",
        "visual_pos_masks",
        "deepstack_visual_embeds",
    }
)
# Families whose mlx-vlm embedding places every row's image features at the
# first row's image positions (it assumes one row): their prompts with
# images are prefilled alone.
_ONE_ROW_IMAGES = frozenset({"aya_vision"})


@dataclass(eq=False)
class Prefilled:
    """Prompts in a batch cache, a row each, ready to join the decode batch.

    Attributes:
        deltas: Their rope deltas (B, 1), for Qwen-VL style models.
        logits: (B, V) of the last prompt tokens, to sample the first tokens
            from; None when the decode step runs the last tokens.
        scores: Each prompt's scores, for those whose ``scored`` is set.
    """

    cache: list[Any]
    deltas: mx.array | None
    logits: mx.array | None = None
    scores: list[PromptScores | None] = field(default_factory=list)


def batchable(
    loaded: LoadedModel, prepared: Prepared, step: int = PREFILL_STEP
) -> bool:
    """Whether a prompt may be prefilled with others: one chunk of ``step``
    tokens, known inputs, and a last token that a decode step can run."""
    return (
        prepared.prompt_tokens <= step
        and set(prepared.inputs) <= _BATCHABLE_INPUTS
        and _text_last(loaded, prepared)
        and batch_caches(loaded.model.language_model, [0]) is not None
        and not (
            "pixel_values" in prepared.inputs
            and loaded.config.model_type in _ONE_ROW_IMAGES
        )
    )


def _text_last(loaded: LoadedModel, prepared: Prepared) -> bool:
    config = loaded.model.config
    media = {getattr(config, name, None) for name in MEDIA_TOKENS}
    return prepared.prompt_tokens > 1 and prepared.last not in media


def prefill_together(
    loaded: LoadedModel, prompts: Sequence[Prepared], quant: KVQuant | None = None
) -> Prefilled:
    """Prefill :func:`batchable` prompts in one pass, left-padded; ``logits``
    holds each one's next-token logits, to sample its first token from."""
    model, lm = loaded.model, loaded.model.language_model
    lengths = [p.prompt_tokens for p in prompts]
    width = max(lengths)
    pads = [width - n for n in lengths]
    ids = mx.concatenate(
        [
            mx.pad(p.inputs["input_ids"], [(0, 0), (pad, 0)])
            for p, pad in zip(prompts, pads, strict=True)
        ]
    )
    mask = mx.array([[0] * pad + [1] * n for pad, n in zip(pads, lengths, strict=True)])
    pixels = [p.inputs["pixel_values"] for p in prompts if "pixel_values" in p.inputs]
    grids = [
        p.inputs["image_grid_thw"] for p in prompts if "image_grid_thw" in p.inputs
    ]
    extra = {"image_grid_thw": mx.concatenate(grids)} if grids else {}
    embedded = model.get_input_embeddings(
        ids, mx.concatenate(pixels) if pixels else None, mask=mask, **extra
    )
    kwargs = _prefill_kwargs(extra, embedded)
    cache = batch_caches(lm, pads, quant)
    assert cache is not None, "batchable() keeps this model's prompts apart"
    scored = any(p.scored is not None for p in prompts)
    output = lm(
        inputs=ids,
        inputs_embeds=embedded.inputs_embeds,
        cache=cache,
        n_to_process=width,
        logits_to_keep=width if scored else 1,
        **kwargs,
    )
    logits = output.logits[:, -1, :]
    scorings: list[Scoring | None] = []
    for row, (prompt, pad) in enumerate(zip(prompts, pads, strict=True)):
        scoring = None
        if prompt.scored is not None:
            # Left padding: the row's positions are its last columns.
            scoring = Scoring(prompt.inputs["input_ids"], prompt.scored)
            scoring.add(output.logits[row, pad:], 0)
        scorings.append(scoring)
    deltas = row_rope_deltas(lm, kwargs, pads, media=bool(pixels))
    mx.eval([c.state for c in cache], deltas, logits)
    scores = [None if s is None else s.scores() for s in scorings]
    return Prefilled(cache, deltas, logits, scores)


class ChunkedPrefill:
    """One prompt's prefill with mlx-vlm's single-stream operations, a chunk per
    :meth:`advance`, so the batch decodes between a long prompt's chunks.

    ``prefix``: the prompt's first tokens from the prompt cache; only the
    tokens after them run. A prompt not of :func:`batchable`'s kind runs its
    last token too, into ``logits``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prepared: Prepared,
        prefix: Prefix | None = None,
        step: int = PREFILL_STEP,
        quant: KVQuant | None = None,
    ) -> None:
        model = loaded.model
        self.loaded, self.prepared, self.step = loaded, prepared, step
        self.lm = model.language_model
        inputs = prepared.inputs
        ids = inputs["input_ids"]
        extra = {
            k: val
            for k, val in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        embedded = model.get_input_embeddings(
            ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra
        )
        self.kwargs = _prefill_kwargs(extra, embedded)
        self.embeds, self.ids = embedded.inputs_embeds, ids
        self.cache = single_caches(self.lm, quant)
        self._ran = 0  # prompt tokens run so far
        self.reused = 0 if prefix is None else prefix.length
        self._scoring = None
        if prepared.scored is not None:
            assert prefix is None or not prefix.length, "a scored prompt is whole"
            self._scoring = Scoring(ids, prepared.scored)
        if prefix is not None and prefix.length:
            restore(self.cache, prefix)
            reused = prefix.length
            self.embeds, self.ids = self.embeds[:, reused:], self.ids[:, reused:]

    @property
    def left(self) -> int:
        """Prompt tokens not yet run."""
        return int(self.embeds.shape[1])

    @property
    def position(self) -> int:
        """Prompt tokens its cache holds."""
        return self.reused + self._ran

    def advance(self, tokens: int | None = None) -> Prefilled | None:
        """Run the next chunk, of ``tokens`` at most (``step`` by default); the
        prompt in a batch cache once it is done."""
        embeds, ids, lm, kwargs = self.embeds, self.ids, self.lm, self.kwargs
        if embeds.shape[1] > 1:
            n = min(tokens or self.step, embeds.shape[1] - 1)
            scoring = self._scoring
            output = lm(
                inputs=ids[:, :n],
                inputs_embeds=embeds[:, :n],
                cache=self.cache,
                n_to_process=n,
                logits_to_keep=1 if scoring is None else n,
                **kwargs,
            )
            if scoring is not None:
                scoring.add(output.logits[0, -n:], self._ran)
            mx.eval([c.state for c in self.cache])
            self._ran += n
            self.embeds, self.ids = embeds[:, n:], ids[:, n:]
            if self.embeds.shape[1] > 1:
                return None
        deltas = rope_deltas(lm, kwargs, 1)
        logits = None
        if not (
            _text_last(self.loaded, self.prepared) and set(kwargs) <= _POSITION_ONLY
        ):
            output = lm(
                self.ids,
                inputs_embeds=self.embeds,
                cache=self.cache,
                logits_to_keep=1,
                **kwargs,
            )
            logits = output.logits[:, -1, :]
        batch_cache = [to_batch(c) for c in self.cache]
        scores = [None if self._scoring is None else self._scoring.scores()]
        return Prefilled(batch_cache, deltas, logits, scores)


def batch_caches(
    lm: Any, pads: list[int], quant: KVQuant | None = None
) -> list[Any] | None:
    """An empty batch cache per layer, with ``pads`` left padding per row, of
    the kind of mlx-vlm's own cache of that layer (a sliding window keeps
    it). None when a layer keeps other state (Qwen3.5's recurrent layers):
    such a model's prompts are prefilled alone, and their caches join."""
    api = vlm()
    caches: list[Any] = []
    layers = api.make_prompt_cache(lm)
    for index, layer in enumerate(layers):
        if isinstance(layer, api.RotatingKVCache) and not layer.keep:
            caches.append(api.BatchRotatingKVCache(layer.max_size, pads))
        elif type(layer).__name__ == "KVCache":
            caches.append(batch_layer(index, len(layers), pads, quant))
        else:
            return None
    return caches


def _prefill_kwargs(extra: dict[str, Any], embedded: Any) -> dict[str, Any]:
    found = {
        k: val
        for k, val in embedded.to_dict().items()
        if k != "inputs_embeds" and val is not None
    }
    return {**extra, **found}
