"""The prefill scheduler's decision for one step (docs/engine.md, "Prefill
scheduling"): the step's token budget, sized by time (:class:`PrefillPacer`),
and which prompts prefill and how many tokens each runs (:func:`plan`). A
value in, a plan out, as vLLM's scheduler returns its ``SchedulerOutput``;
nothing here runs a model. Any thread (a pacer: its owner's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_LONG",
    "MAX_PARTIAL",
    "Limits",
    "Plan",
    "PrefillPacer",
    "Waiting",
    "plan",
]

# The fewest tokens a paced chunk has: below it, a pass costs more for its
# own overhead than its tokens save.
MIN_CHUNK = 64
#: While nobody waits on a chunk, it takes this many times the budget: a
#: prompt that arrives meanwhile waits at most that long for its turn.
IDLE = 2


class PrefillPacer:
    """The token count of the next chunk of a long prompt's prefill.

    Args:
        budget: Seconds a chunk should take while rows decode; None: every
            chunk is ``cap`` tokens.
        cap: The most tokens a chunk has (``--prefill-step-size``).
    """

    def __init__(self, budget: float | None, cap: int) -> None:
        self.budget = budget
        self.cap = cap
        # Seconds per token of the last chunk, None before the first: that
        # one is MIN_CHUNK tokens while rows decode, to learn the model.
        self.per_token: float | None = None

    def tokens(self, *, decoding: bool) -> int:
        """The next chunk's size; ``decoding``: whether rows (or a prompt that
        ends in the step) wait on it, else it takes :data:`IDLE` budgets."""
        if self.budget is None:
            return self.cap
        if self.per_token is None:
            return min(self.cap, MIN_CHUNK)
        seconds = self.budget * (1 if decoding else IDLE)
        return max(MIN_CHUNK, min(self.cap, int(seconds / self.per_token)))

    def spent(self, seconds: float) -> bool:
        """Whether a step's prefill that took ``seconds`` is all it may have while
        something waits on it."""
        return self.budget is not None and seconds >= self.budget

    def observe(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` took ``seconds``: the next is sized by it (the cost
        per token only grows along a prompt)."""
        if tokens > 0 and seconds > 0:
            self.per_token = seconds / tokens


#: Prompts prefilled a chunk at a time in one step, at most (vLLM's
#: ``max_num_partial_prefills``), and the long ones among them
#: (``max_long_partial_prefills``): a short prompt that arrives while a
#: long one prefills goes in beside it, a second long one waits its turn.
MAX_PARTIAL = 8
MAX_LONG = 1


@dataclass(frozen=True)
class Waiting:
    """A prompt in prefill, as the plan sees it.

    Attributes:
        left: Tokens its chunks have yet to run.
        priority: Lower is sooner (the request's ``priority``).
        arrival: Its place in the order of admission.
        together: It runs whole, in one padded pass with the others so
            marked (a short prompt not started from the cache).
        abandoned: Its client left: it runs after every other prompt.
        provider: The index of the prompt whose prefill it waits for (it
            shares that one's prefix), or None; that one takes its priority.
    """

    left: int
    priority: int = 0
    arrival: int = 0
    together: bool = False
    abandoned: bool = False
    provider: int | None = None


@dataclass(frozen=True)
class Limits:
    """A step's budget. ``tokens``: its chunks' tokens together; ``long``: a
    prompt with more left is long (vLLM's ``long_prefill_token_threshold``);
    ``least``: the fewest tokens a chunk is given (fewer prompts share a
    smaller budget)."""

    tokens: int
    long: int
    least: int = 1
    partial: int = MAX_PARTIAL
    long_partial: int = MAX_LONG


@dataclass(frozen=True)
class Plan:
    """What a step prefills: ``together``, whole, in padded passes (in order);
    then each of ``runs`` (a prompt's index and its chunk's tokens: those
    that end first), each pass while the step's time lasts (the first
    always)."""

    together: tuple[int, ...] = ()
    runs: tuple[tuple[int, int], ...] = ()


def plan(waiting: Sequence[Waiting], limits: Limits) -> Plan:
    """The step's plan. The prompts go in order of priority, then arrival (an
    abandoned one last; a prompt others wait for at the most urgent of their
    priorities). Up to ``limits.partial`` of those that run in chunks share
    the budget, at most ``limits.long_partial`` of them long (a long one past
    it waits); each has an equal share of the tokens: a prompt that ends
    within its share runs whole, and the rest of the budget is shared by
    the others, as many as get ``limits.least`` tokens each (the first at
    least, if the budget is smaller)."""
    urgent = [(w.abandoned, w.priority) for w in waiting]
    for w in waiting:
        if w.provider is not None:
            urgent[w.provider] = min(urgent[w.provider], (False, w.priority))
    order = sorted(
        (i for i, w in enumerate(waiting) if w.provider is None),
        key=lambda i: (*urgent[i], waiting[i].arrival),
    )
    together = tuple(i for i in order if waiting[i].together)
    chosen: list[int] = []
    longs = 0
    for i in order:
        if waiting[i].together or len(chosen) == limits.partial:
            continue
        long = waiting[i].left > limits.long
        if long and longs == limits.long_partial:
            continue
        longs += long
        chosen.append(i)
    if not chosen:
        return Plan(together)
    share = limits.tokens // len(chosen)
    runs = {i: waiting[i].left for i in chosen if waiting[i].left <= share}
    pool = limits.tokens - sum(runs.values())
    rest = [i for i in chosen if i not in runs]
    rest = rest[: max(1, pool // max(limits.least, 1))]
    for k, i in enumerate(rest):
        runs[i] = min(waiting[i].left, pool // (len(rest) - k))
        pool -= runs[i]
    # Those that end first: their rows wait on the step, and they are cheap.
    ends = [i for i in chosen if runs.get(i) == waiting[i].left]
    rest = [i for i in chosen if i in runs and i not in ends]
    return Plan(together, tuple((i, runs[i]) for i in (*ends, *rest)))
