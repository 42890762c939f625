"""Per-row sampling for the decode batch: :func:`draw` builds and starts the
graph, :func:`collect` waits for it, so the MLX thread is free while a
step computes. Rows draw as mlx-vlm draws one stream (a key per seed and
position), so a seed gives the same tokens alone, batched, or through
``mlx_vlm.stream_generate``. MLX thread only.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..events import SamplingParams


class Sampled(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]
    eos: bool


class Sampling(Protocol):
    """What sampling needs to know of a row."""

    @property
    def sampling(self) -> SamplingParams: ...  # resolved (rows.resolve_sampling)
    @property
    def sampled(self) -> int: ...  # the position of the token to sample


def free_draw(sampling: SamplingParams) -> bool:
    """Whether a row's draw picks the greatest of its log-probabilities (plus
    its key's noise) over the whole vocabulary: greedy, or temperature
    alone, with no top-p, top-k or min-p that depends on the other tokens."""
    temperature, top_p = cast("float", sampling.temperature), sampling.top_p
    return temperature <= 0 or (
        not 0 < cast("float", top_p) < 1 and not sampling.top_k and sampling.min_p <= 0
    )


@dataclass
class Draw:
    """A step's sampling graph, started and not yet waited for."""

    tokens: mx.array
    chosen: mx.array | None  # None: no row reads its logprob
    wanted: list[int]  # rows that asked for top logprobs
    top_ids: mx.array | None
    top_values: mx.array | None
    keep: int  # the most alternatives a row asked for
    top_sizes: list[int]
    ends: list[SamplingParams]  # each row's, for whether its token ends it
    # Rows drawn without their grammar's mask (:func:`.logits.speculates`),
    # to be checked when read; with the logits and bias they were drawn from.
    speculative: Sequence[int] = ()
    logits: mx.array | None = None
    bias: mx.array | None = None


def draw(
    logits: mx.array,
    rows: Sequence[Sampling],
    bias: mx.array | None,
    also: Sequence[Any] = (),
    ahead: Sequence[int] = (),
    speculative: Sequence[int] = (),
) -> Draw:
    """Build one token per row of ``logits`` (B, V) and start computing it, with
    ``also`` (the caches' states, so their graph does not grow). ``ahead``:
    per row, its tokens sampled but not yet counted in its ``sampled``.
    ``speculative``: the rows drawn without their grammar's mask."""
    api = vlm()
    kept = (speculative, logits, bias) if speculative else ((), None, None)
    if bias is not None:
        logits = logits + bias
    barred = barred_tokens(rows, ahead, logits.shape[-1])
    if barred is not None:
        allowed = mx.where(mx.array(barred), -mx.inf, logits)
        # A row left no token at all (allowed_token_ids all held off by
        # min_tokens, or all outside its grammar) keeps its logits.
        empty = mx.all(allowed == -mx.inf, axis=-1, keepdims=True)
        logits = mx.where(empty, logits, allowed)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.argmax(logprobs, axis=-1)
    groups: dict[tuple[float, float, int, float], list[int]] = {}
    for i, row in enumerate(rows):
        sampling = row.sampling
        temperature = cast("float", sampling.temperature)
        if temperature > 0:
            key = (temperature, cast("float", sampling.top_p), sampling.top_k or 0)
            groups.setdefault((*key, sampling.min_p), []).append(i)
    for (temperature, top_p, top_k, min_p), members in groups.items():
        index = mx.array(members, dtype=mx.int32)
        group = logprobs[index]
        if top_k > 0:
            group = api.apply_top_k(group, top_k)
        if min_p > 0:
            floor = mx.max(group, axis=-1, keepdims=True) + math.log(min_p)
            group = mx.where(group < floor, -mx.inf, group)
        keys = mx.stack(
            [
                mx.random.key(
                    position_seed(
                        cast("int", rows[i].sampling.seed),
                        0,
                        rows[i].sampled + (ahead[i] if ahead else 0),
                    )
                )
                for i in members
            ]
        )
        drawn = mx.vmap(_drawer(temperature, top_p), in_axes=(0, 0))(group, keys)
        tokens[index] = drawn.astype(tokens.dtype)
    targets: list[Any] = [tokens]
    chosen = None
    if any(row.sampling.logprobs for row in rows):
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        targets.append(chosen)
    wanted = [i for i, row in enumerate(rows) if row.sampling.top_logprobs]
    top_ids = top_values = None
    keep = 0
    if wanted:
        keep = max(rows[i].sampling.top_logprobs for i in wanted)
        keep = min(keep, logprobs.shape[-1])
        scores = logprobs[mx.array(wanted, dtype=mx.int32)]
        top_ids = mx.argpartition(-scores, kth=keep - 1, axis=-1)[:, :keep]
        top_values = mx.take_along_axis(scores, top_ids, axis=-1)
        targets += [top_ids, top_values]
    targets.extend(also)
    mx.async_eval(targets)  # type: ignore[no-untyped-call]
    sizes = [rows[i].sampling.top_logprobs for i in wanted]
    ends = [row.sampling for row in rows]
    return Draw(tokens, chosen, wanted, top_ids, top_values, keep, sizes, ends, *kept)


def barred_tokens(
    rows: Sequence[Sampling], ahead: Sequence[int], vocab: int
) -> np.ndarray | None:
    """(B, V) true for the tokens a row may not draw at its position: outside
    its ``allowed_token_ids``, and its ends of turn before ``min_tokens``;
    None when no row bars any."""
    barred: np.ndarray | None = None
    for i, row in enumerate(rows):
        sampling = row.sampling
        position = row.sampled + (ahead[i] if ahead else 0)
        held = sampling.held_token_ids if position < sampling.min_tokens else ()
        if not held and not sampling.allowed_token_ids:
            continue
        if barred is None:
            barred = np.zeros((len(rows), vocab), dtype=np.bool_)
        if sampling.allowed_token_ids:
            barred[i] = True
            barred[i, [t for t in sampling.allowed_token_ids if t < vocab]] = False
        barred[i, [t for t in held if t < vocab]] = True
    return barred


def collect(pending: Draw) -> list[Sampled]:
    """Wait for a :class:`Draw` and read its rows' tokens, in row order."""
    tokens = cast("list[int]", pending.tokens.tolist())
    chosen = (
        [math.nan] * len(tokens)  # no row reads its logprob
        if pending.chosen is None
        else cast("list[float]", pending.chosen.tolist())
    )
    tops: dict[int, list[tuple[int, float]]] = {}
    if pending.top_ids is not None and pending.top_values is not None:
        ids = cast("list[list[int]]", pending.top_ids.tolist())
        values = cast("list[list[float]]", pending.top_values.tolist())
        for j, (i, size) in enumerate(
            zip(pending.wanted, pending.top_sizes, strict=True)
        ):
            pairs = sorted(zip(ids[j], values[j], strict=True), key=lambda p: -p[1])
            tops[i] = pairs[:size]
    return [
        Sampled(token, chosen[i], tops.get(i, []), pending.ends[i].ends(token))
        for i, token in enumerate(tokens)
    ]


def position_seed(seed: int, row: int, position: int) -> int:
    """The sampling key's seed of a seeded request at a token position: the
    mix mlx-vlm's ``stream_generate`` keys its draws with (0.7.10), copied
    so the engine reads no private name (a test compares the two)."""
    mixed = (int(seed) ^ 0x9E3779B9) & 0xFFFFFFFF
    mixed = (mixed + (int(row) + 1) * 0x85EBCA6B) & 0xFFFFFFFF
    mixed = (mixed ^ ((int(position) + 1) * 0xC2B2AE35)) & 0xFFFFFFFF
    mixed ^= mixed >> 16
    mixed = (mixed * 0x7FEB352D) & 0xFFFFFFFF
    mixed ^= mixed >> 15
    return mixed & 0xFFFFFFFF


@functools.cache
def _drawer(temperature: float, top_p: float) -> Any:
    """One row's draw with its key, as mlx-vlm's position-keyed sampler draws
    (for ``mx.vmap`` over rows)."""
    api = vlm()
    if 0 < top_p < 1.0:

        def nucleus(logprobs: mx.array, key: mx.array) -> mx.array:
            drawn: mx.array = api.top_p_sampling(logprobs, top_p, temperature, key=key)
            return drawn

        return nucleus
    scale = 1 / temperature

    def categorical(logprobs: mx.array, key: mx.array) -> mx.array:
        return mx.random.categorical(logprobs * scale, key=key)

    return categorical


class VLM:
    """The mlx-vlm functions the batch uses, imported on first use."""

    def __init__(self) -> None:
        common = importlib.import_module("mlx_vlm.generate.common")
        sample = importlib.import_module("mlx_vlm.sample_utils")
        utils = importlib.import_module("mlx_vlm.utils")
        cache = importlib.import_module("mlx_vlm.models.cache")
        self.resolve_sampling_defaults = common.resolve_sampling_defaults
        self.clamp_temperature = sample.clamp_temperature
        self.apply_top_k = sample.apply_top_k
        self.top_p_sampling = sample.top_p_sampling
        self.prepare_inputs = utils.prepare_inputs
        self.should_add_special_tokens = utils.should_add_special_tokens
        self.make_prompt_cache = cache.make_prompt_cache
        self.BatchKVCache = cache.BatchKVCache
        self.RotatingKVCache = cache.RotatingKVCache
        self.BatchRotatingKVCache = cache.BatchRotatingKVCache


@functools.cache
def vlm() -> VLM:
    return VLM()
