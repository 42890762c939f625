"""A request made into a row of the batch: MLX thread only.

:func:`make_row` resolves the request's sampling settings against the
checkpoint's defaults, runs the chat template and the processor, checks the
prompt's limits, and prepares what the row's logits need (its grammar's
matcher, the prompt's tokens for a repetition penalty, its prompt-cache key,
which holds its images', videos' and audio files' content hashes).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..failures import ImagesUnsupportedError, InvalidGrammarError
from ..row_needs import Reason, needs_of
from .logits import GrammarMatcher, banned_sequences, new_matcher, prompt_seen
from .prefill import MEDIA_TOKENS, preprocess
from .prompt_cache import audio_hash, image_hash, prompt_key
from .rows import Row
from .sampling import vlm
from .thinking_budget import ThinkingBudget

if TYPE_CHECKING:
    from PIL import Image

    from ..events import GenerationParams, Grammar, SamplingParams
    from ..row_needs import RowNeeds
    from .model import LoadedModel

__all__ = ["make_row", "media_tokens"]


def make_row(
    loaded: LoadedModel,
    params: GenerationParams,
    images: Sequence[Image.Image],
    *,
    media: frozenset[int] | None = None,
) -> Row:
    """A new row for a request, its prompt preprocessed; ``media``: the
    model's media tokens, when the row gets a prompt-cache key.

    Raises:
        ImagesUnsupportedError: Images sent to a text model.
        PromptTooLongError: A prompt over the request's limits.
        InvalidGrammarError: A grammar llguidance refuses.
        Exception: Whatever the processor raises for its inputs.
    """
    if images and not loaded.accepts_images:
        # The HTTP side refuses it first and names the part; this guards other
        # callers, as a text model's prompt would silently drop the image.
        raise ImagesUnsupportedError()
    sampling = resolve_sampling(loaded, params.sampling)
    needs = needs_of(params)
    prepared = preprocess(loaded, params, images)
    prepared.scored = sampling.prompt_logprobs
    # Refused before anything is prefilled.
    params.check_prompt_tokens(prepared.prompt_tokens)
    row = Row(
        max_tokens=max(params.max_tokens, 1),  # 0: one sampled, none handed out
        sampling=sampling,
        needs=needs,
        prompt_tokens=prepared.prompt_tokens,
        token=prepared.last,
        prepared=prepared,
        matcher=_matcher(loaded, params.grammar),
        thinking=_thinking(loaded, params, needs),
        banned=tuple(map(tuple, banned_sequences(loaded, sampling.bad_words))),
    )
    if params.prediction:
        encode = loaded.tokenizer.encode
        row.prediction = np.asarray(encode(params.prediction, add_special_tokens=False))
    ids = prepared.inputs["input_ids"]
    if sampling.repetition_penalty != 1.0:
        row.seen = prompt_seen(ids, loaded.vocab_size)
    if media is not None:
        hashes = [image_hash(image) for image in images]
        row.key = prompt_key(
            cast("list[int]", ids[0].tolist()),
            hashes,
            media,
            *_video_keys(loaded, params, prepared.inputs),
            [audio_hash(audio.digest) for audio in params.audios],
            getattr(loaded.model.config, "audio_token_id", None),
        )
    return row


def resolve_sampling(loaded: LoadedModel, sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with the checkpoint's defaults filled in (as mlx-vlm
    fills them), a seed drawn where the request set none, and the model's
    end-of-turn tokens."""
    api = vlm()
    temperature, top_p, top_k = api.resolve_sampling_defaults(
        getattr(loaded.model, "config", None),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )
    seed = sampling.seed
    return replace(
        sampling,
        temperature=float(api.clamp_temperature(temperature)),
        top_p=float(top_p),
        top_k=int(top_k or 0),
        seed=random.getrandbits(32) if seed is None else seed,
        top_logprobs=sampling.top_logprobs if sampling.logprobs else 0,
        eos_token_ids=end_of_turn_ids(loaded),
    )


def end_of_turn_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """The model's end-of-turn tokens (its tokenizer's stopping criteria)."""
    stopping = loaded.tokenizer.stopping_criteria
    return tuple(int(t) for t in getattr(stopping, "eos_token_ids", None) or ())


def _video_keys(
    loaded: LoadedModel, params: GenerationParams, inputs: dict[str, Any]
) -> tuple[list[tuple[int, int]], int | None]:
    """Each video's content hash and its count of video tokens (from its
    ``video_grid_thw``), and the video token."""
    grids = inputs.get("video_grid_thw")
    if not params.videos or grids is None:
        return [], None
    config = loaded.model.config
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1)
    rows = cast("list[list[int]]", grids.tolist())
    counts = [t * h * w // int(merge) ** 2 for t, h, w in rows]
    token = getattr(config, "video_token_id", None)
    token = token if token is not None else getattr(config, "video_token_index", None)
    keys = [(v.digest, n) for v, n in zip(params.videos, counts, strict=True)]
    return keys, token


def _matcher(loaded: LoadedModel, grammar: Grammar | None) -> GrammarMatcher | None:
    """A fresh matcher for ``grammar`` (compiled once per grammar, copied
    from the model's own)."""
    if grammar is None:
        return None
    try:
        return new_matcher(loaded, grammar)
    except ValueError as exc:
        raise InvalidGrammarError(f"{exc}.") from None


def _thinking(
    loaded: LoadedModel, params: GenerationParams, needs: RowNeeds
) -> ThinkingBudget | None:
    """The row's thinking budget, its markers tokenized; None where its
    needs have none, or its closing marker has no tokens."""
    if Reason.THINKING_BUDGET not in needs.reasons:
        return None
    budget, markers = params.thinking_budget, params.thinking_markers
    assert budget is not None  # as needs_of found it
    assert markers is not None
    opening, closing = (_marker_ids(loaded, text) for text in markers)
    if not closing:
        return None
    return ThinkingBudget(max(budget, 0), opening, closing)


def _marker_ids(loaded: LoadedModel, text: str) -> list[int]:
    """A marker's token ids (a single special token where the vocabulary
    has one)."""
    if not text:
        return []
    return cast("list[int]", loaded.tokenizer.encode(text, add_special_tokens=False))


def media_tokens(loaded: LoadedModel) -> frozenset[int]:
    """The model's image, video and audio placeholder token ids."""
    config = loaded.model.config
    found = {getattr(config, name, None) for name in MEDIA_TOKENS}
    return frozenset(token for token in found if isinstance(token, int))
