"""A row of the decode batch: one sequence, made from its request at
admission (:func:`make_row`) and given its sampled tokens (:func:`read`).
MLX thread only.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from ..events import SamplingParams
from ..failures import ImagesUnsupportedError, InvalidGrammarError
from ..row_needs import Reason, RowNeeds, needs_of
from .logits import GrammarMatcher, advance, banned_sequences, new_matcher, prompt_seen
from .model_inputs import MEDIA_TOKENS, Prepared, preprocess
from .prompt_cache import Key, audio_hash, image_hash, prompt_key
from .prompt_lookup import History
from .sampling import Sampled, vlm
from .thinking_budget import ThinkingBudget

if TYPE_CHECKING:
    from PIL import Image

    from ..events import GenerationParams, Grammar
    from .model import LoadedModel
    from .prompt_scores import PromptScores

__all__ = ["Row", "end_of_turn_ids", "make_row", "media_tokens", "read"]


@dataclass(eq=False)
class Row:
    """One sequence: its sampling settings and where it stands.

    Attributes:
        max_tokens: Tokens to sample: the request's ``max_tokens``, cut to
            what the context leaves after the prompt (1 where it asks 0).
        sampling: Its request's sampling, resolved (:func:`resolve_sampling`).
        token: The last sampled token: the next step's input, not yet cached.
        sampled: Tokens sampled so far; also the next sampling position.
        pending: Sampled tokens its request has not turned into events yet.
        done: No more tokens will be sampled (end of turn or ``max_tokens``).
        gone: Its request left; tokens still in flight for it are dropped.
        counts: (V,) times each token was generated, while it is penalized.
        seen: (V,) the prompt's tokens, while a repetition penalty reads them.
        key: Its prompt's cache key, when the prompt cache may hold it.
        tokens: Its sampled tokens, kept while ``key`` is (for the cache).
        history: Its prompt's and answer's token ids, while the batch drafts.
        recent: Its last generated tokens, as many as its longest bad word.
        predicted: Tokens of its prediction verified, and those kept.
        acceptance: Its running share of drafts kept (:mod:`.drafting`).
        rest: How many tokens it last rested from drafting, and
            ``rests_until`` its ``sampled`` count when it drafts again.
        prefilled: Prompt tokens in its KV so far (cached ones included),
            as its prefill last left it: its request's progress reports.
    """

    max_tokens: int
    sampling: SamplingParams
    needs: RowNeeds = field(default_factory=RowNeeds)
    priority: int = 0  # its request's: lower is sooner
    prompt_tokens: int = 0
    token: int = 0
    sampled: int = 0
    pending: deque[Sampled] = field(default_factory=deque)
    done: bool = False
    gone: bool = False
    error: BaseException | None = None
    prepared: Prepared | None = None  # its inputs, until its prefill
    bias_row: mx.array | None = None
    counts: mx.array | None = None
    seen: mx.array | None = None
    matcher: GrammarMatcher | None = None
    key: Key | None = None
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    thinking: ThinkingBudget | None = None
    history: History | None = None
    scores: PromptScores | None = None
    banned: tuple[tuple[int, ...], ...] = ()
    recent: list[int] = field(default_factory=list)
    prediction: np.ndarray | None = None
    predicted: tuple[int, int] = (0, 0)
    acceptance: float = 1.0
    rest: int = 0
    rests_until: int = 0
    prefilled: int = 0

    def constrained(self) -> bool:
        """Whether its next mask needs its last token read (a thinking budget's
        only while it can still force a token)."""
        if self.gone or self.done or not self.needs.constrained:
            return False
        closed = self.thinking is None or not self.thinking.open
        return any(
            reason.constrains and not (reason is Reason.THINKING_BUDGET and closed)
            for reason in self.needs.reasons
        )

    def record(self, item: Sampled) -> None:
        self.pending.append(item)
        self.token = item.token
        self.sampled += 1
        if self.thinking is not None:
            self.thinking.observe(item.token)
        self.done = item.eos or self.sampled >= self.max_tokens
        if self.key is not None:
            self.tokens.append(item.token)
        if self.history is not None:
            self.history.append(item.token)
        if self.banned:
            self.recent.append(item.token)
            del self.recent[: -max(len(word) for word in self.banned)]


def read(
    rows: Sequence[Row],
    items: Sequence[Sequence[Sampled]],
    consumed: Collection[Row] = (),
) -> tuple[list[Row], int]:
    """Give each row its tokens of a step (``items[i]``, up to the one that
    ends it) and advance its grammar past them (unless ``consumed``); the
    rows read, and how many tokens they got. A row that left, or that a
    token of the step before ended, gets none (they were computed ahead).
    """
    read: list[Row] = []
    tokens = 0
    for row, sampled in zip(rows, items, strict=True):
        if row.gone or row.done:
            continue
        for item in sampled:
            row.record(item)
            tokens += 1
            if row.done:
                break
        read.append(row)
    advance([row for row in read if row not in consumed])
    return read, tokens


def make_row(
    loaded: LoadedModel,
    params: GenerationParams,
    images: Sequence[Image.Image],
    *,
    media: frozenset[int] | None = None,
) -> Row:
    """A new row for a request; ``media``: the model's media tokens, when the
    row gets a prompt-cache key.

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
    most = params.max_tokens_for(prepared.prompt_tokens)
    row = Row(
        max_tokens=max(most, 1),  # 0: one sampled, none handed out
        sampling=sampling,
        needs=needs,
        priority=params.priority,
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
    """``sampling`` with the checkpoint's defaults filled in (as mlx-vlm fills
    them), a seed drawn where the request set none, and the model's
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
    stopping = loaded.tokenizer.stopping_criteria
    return tuple(int(t) for t in getattr(stopping, "eos_token_ids", None) or ())


def _video_keys(
    loaded: LoadedModel, params: GenerationParams, inputs: dict[str, Any]
) -> tuple[list[tuple[int, int]], int | None]:
    """Each video's content hash and its count of video tokens, and the video
    token."""
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
    if grammar is None:
        return None
    try:
        return new_matcher(loaded, grammar)
    except ValueError as exc:
        raise InvalidGrammarError(f"{exc}.") from None


def _thinking(
    loaded: LoadedModel, params: GenerationParams, needs: RowNeeds
) -> ThinkingBudget | None:
    """None where its needs have no budget, or its closing marker no tokens."""
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
    if not text:
        return []
    return cast("list[int]", loaded.tokenizer.encode(text, add_special_tokens=False))


def media_tokens(loaded: LoadedModel) -> frozenset[int]:
    """The model's image, video and audio placeholder token ids."""
    config = loaded.model.config
    found = {getattr(config, name, None) for name in MEDIA_TOKENS}
    return frozenset(token for token in found if isinstance(token, int))
