"""A sequence of the decode batch (a row) and the batch's statistics.

Rows are made, read and changed on the MLX thread only; a
:class:`BatchStatistics` is a frozen snapshot, readable anywhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..events import SamplingParams
from ..row_needs import Reason, RowNeeds
from .logits import GrammarMatcher, advance
from .prefill import Prepared, PromptScores
from .prompt_cache import Key
from .prompt_lookup import History
from .sampling import Sampled
from .thinking_budget import ThinkingBudget

__all__ = ["BatchStatistics", "Row", "read"]


@dataclass(eq=False)
class Row:
    """One sequence: its sampling settings and where it stands.

    Attributes:
        max_tokens: Most tokens to sample.
        sampling: Its request's sampling, resolved: the checkpoint's defaults
            filled in (temperature 0 is greedy) and its seed drawn.
        needs: What its logits read of the tokens before them, decided
            from its request at admission (:func:`..row_needs.needs_of`).
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
        scores: Its prompt's log-probabilities, once prefilled, when its
            request asked for them.
        banned: Its bad words' token ids (:func:`.logits.ban_words`).
        recent: Its last generated tokens, as many as its longest bad word
            reads, while it has any.
        prediction: Its request's predicted answer, as token ids: its
            drafts (:mod:`.drafting`).
        predicted: Tokens of its prediction verified, and those kept.
        acceptance: Its running share of drafts kept (:mod:`.drafting`).
        rest: How many tokens it last rested from drafting, and
            ``rests_until`` its ``sampled`` count when it drafts again.
    """

    max_tokens: int
    sampling: SamplingParams
    needs: RowNeeds = field(default_factory=RowNeeds)
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
    scores: PromptScores | None = None
    banned: tuple[tuple[int, ...], ...] = ()
    recent: list[int] = field(default_factory=list)
    prediction: np.ndarray | None = None
    predicted: tuple[int, int] = (0, 0)
    acceptance: float = 1.0
    rest: int = 0
    rests_until: int = 0

    def constrained(self) -> bool:
        """Whether its next mask needs its last token read: its needs say so
        and it is not done (a thinking budget only while it can still
        force a token)."""
        if self.gone or self.done or not self.needs.constrained:
            return False
        closed = self.thinking is None or not self.thinking.open
        return any(
            reason.constrains and not (reason is Reason.THINKING_BUDGET and closed)
            for reason in self.needs.reasons
        )

    def record(self, item: Sampled) -> None:
        """Give it a sampled token: its request reads it from ``pending``."""
        self.pending.append(item)
        self.token = item.token
        self.sampled += 1
        if self.thinking is not None:
            self.thinking.observe(item.token)
        self.done = item.eos or self.sampled >= self.max_tokens
        if self.key is not None:
            self.tokens.append(item.token)
        if self.history is not None:  # speculative decoding (.drafting)
            self.history.append(item.token)
        if self.banned:
            self.recent.append(item.token)
            del self.recent[: -max(len(word) for word in self.banned)]


def read(
    rows: Sequence[Row],
    items: Sequence[Sequence[Sampled]],
    consumed: Collection[Row] = (),
) -> tuple[list[Row], int]:
    """Give each row its tokens of a step (``items[i]``, in order, up to the
    one that ends it) and advance its grammar past them (but for the rows
    whose grammar ``consumed`` them already); the rows read, and how many
    tokens they got.

    A row that left while the step ran, or whose token in the step before
    ended it (end of turn), gets none: its tokens were computed ahead, for
    nothing.
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
