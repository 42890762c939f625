"""A sequence of the decode batch (a row) and the batch's statistics.

Rows are made, read and changed on the MLX thread only; a
:class:`BatchStatistics` is a frozen snapshot, readable anywhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..events import SamplingParams
from .logits import GrammarMatcher
from .prefill import Prepared
from .prompt_cache import Key
from .prompt_lookup import History
from .sampling import Sampled
from .thinking import ThinkingBudget

__all__ = ["BatchStatistics", "Row"]


@dataclass(eq=False)
class Row:
    """One sequence: its sampling settings and where it stands.

    Attributes:
        max_tokens: Most tokens to sample.
        sampling: Its request's sampling, resolved: the checkpoint's defaults
            filled in (temperature 0 is greedy) and its seed drawn.
        prompt_tokens: Tokens in the prompt, image tokens included.
        token: The last sampled token: the next step's input, not yet cached.
        sampled: Tokens sampled so far; also the next sampling position.
        pending: Sampled tokens its request has not turned into events yet.
        done: No more tokens will be sampled (end of turn or ``max_tokens``).
        gone: Its request left; tokens still in flight for it are dropped.
        error: Why the batch failed under it, if it did.
        counts: (V,) times each token was generated, while it is penalized.
        seen: (V,) the prompt's tokens, while a repetition penalty reads them.
        matcher: Its grammar's matcher, when its text is constrained.
        key: Its prompt's cache key, when the prompt cache may hold it.
        tokens: Its sampled tokens, kept while ``key`` is (the answer's KV
            is cached under the prompt's key and these when it leaves).
        cached: Prompt tokens it took from the prompt cache.
        thinking: Its thinking budget, when the request set one and the
            model's reasoning format has markers.
        history: Its prompt's and answer's token ids, while the batch
            drafts by prompt lookup (:mod:`.drafting`).
    """

    max_tokens: int
    sampling: SamplingParams
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
    history: History | None = None  # speculative decoding (.drafting)


@dataclass(frozen=True)
class BatchStatistics:
    """A snapshot of one model's batch.

    Attributes:
        active: Rows in the decode batch now.
        joining: Rows prefilled and waiting for the next step to join.
        peak_active: Most rows ever decoded in one step.
        steps: Batched decode steps run.
        decoded_tokens: Tokens sampled by those steps (prefill tokens excluded).
        prefills: Prompts prefilled.
        prefill_passes: Prefill passes run: prompts queued together share one.
        prefill_seconds: Time spent in prefills.
        step_seconds: Time spent in decode steps.
        speculative_steps: Decode steps that verified drafts
            (:mod:`.drafting`).
        speculative_rows: Rows of those steps, summed over the steps: each
            gave one token and the drafts it kept.
        draft_tokens: Draft tokens those steps verified.
        accepted_tokens: Draft tokens they kept.
    """

    active: int
    joining: int
    peak_active: int
    steps: int
    decoded_tokens: int
    prefills: int
    prefill_passes: int
    prefill_seconds: float
    step_seconds: float
    # speculative decoding (.drafting)
    speculative_steps: int = 0
    speculative_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
