"""What a generation's logits read of the tokens before them: one decision
per request, read by the HTTP side (a ``prediction`` it could not use) and
by the engine (the decode step, drafting). Any thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .events import GenerationParams

__all__ = ["Reason", "RowNeeds", "needs_of"]


class Reason(enum.Enum):
    """Something a request sets that makes its logits at a position read
    the tokens before it.

    Attributes:
        field: What a 400 names: the request fields that set it.
        constrains: Its mask is computed on the host from the row's last
            token, so the next step's mask waits for that token to be read.
        drafts: A verify pass applies it at every draft position (from the
            drafts before that position), so the row can still draft.
    """

    GRAMMAR = (
        "a grammar (response_format, structured_outputs or tool_choice)",
        True,
        False,
    )
    THINKING_BUDGET = (
        "a thinking budget (thinking_token_budget or reasoning_effort)",
        True,
        False,
    )
    BAD_WORDS = ("bad_words", True, True)
    PRESENCE_PENALTY = ("presence_penalty", False, False)
    FREQUENCY_PENALTY = ("frequency_penalty", False, False)
    REPETITION_PENALTY = ("repetition_penalty", False, False)

    field: str
    constrains: bool
    drafts: bool

    def __init__(self, field: str, constrains: bool, drafts: bool) -> None:
        self.field = field
        self.constrains = constrains
        self.drafts = drafts


@dataclass(frozen=True)
class RowNeeds:
    """What one generation needs: each :class:`Reason` its request gives,
    in declaration order."""

    reasons: tuple[Reason, ...] = ()

    @property
    def constrained(self) -> bool:
        """Whether its next mask needs its last token read (the engine's
        row narrows it: a thinking budget only while its reasoning is
        open)."""
        return any(reason.constrains for reason in self.reasons)

    @property
    def undraftable(self) -> tuple[Reason, ...]:
        """The reasons it cannot draft, nor use a ``prediction``; empty:
        it can."""
        return tuple(reason for reason in self.reasons if not reason.drafts)


def needs_of(params: GenerationParams) -> RowNeeds:
    """The one decision for a request. A thinking budget counts where it
    applies: with the model's markers and no grammar."""
    sampling = params.sampling
    markers = params.thinking_markers
    given = {
        Reason.GRAMMAR: params.grammar is not None,
        Reason.THINKING_BUDGET: params.thinking_budget is not None
        and markers is not None
        and bool(markers[1])
        and params.grammar is None,
        Reason.BAD_WORDS: bool(sampling.bad_words),
        Reason.PRESENCE_PENALTY: sampling.presence_penalty != 0.0,
        Reason.FREQUENCY_PENALTY: sampling.frequency_penalty != 0.0,
        Reason.REPETITION_PENALTY: sampling.repetition_penalty != 1.0,
    }
    return RowNeeds(tuple(reason for reason in Reason if given[reason]))
