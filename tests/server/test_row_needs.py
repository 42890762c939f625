"""The one decision of what a row's logits read of the tokens before them
(row_needs.py), and the row's runtime part of it (Row.constrained)."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_pinned.server.engine.rows import Row
from mlx_pinned.server.engine.thinking_budget import ThinkingBudget
from mlx_pinned.server.events import GenerationParams, Grammar, SamplingParams
from mlx_pinned.server.row_needs import Reason, RowNeeds, needs_of

from .kit import generation

MARKERS = ("<think>", "</think>")

# Each reason, and the request fields that give it alone.
GIVEN: dict[Reason, dict[str, Any]] = {
    Reason.GRAMMAR: {"grammar": Grammar("json_object")},
    Reason.THINKING_BUDGET: {"thinking_budget": 8, "thinking_markers": MARKERS},
    Reason.BAD_WORDS: {"bad_words": ("no",)},
    Reason.PRESENCE_PENALTY: {"presence_penalty": 0.5},
    Reason.FREQUENCY_PENALTY: {"frequency_penalty": -0.5},
    Reason.REPETITION_PENALTY: {"repetition_penalty": 1.1},
}


def params(**fields: Any) -> GenerationParams:
    messages = ({"role": "user", "content": "hi"},)
    return generation(messages, max_tokens=8, **fields)


def test_every_reason_has_a_request_that_gives_it() -> None:
    assert set(GIVEN) == set(Reason)


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.name)
def test_each_reason_is_reported_by_the_one_decision(reason: Reason) -> None:
    assert needs_of(params(**GIVEN[reason])).reasons == (reason,)


# The wire field a 400 must name for each reason.
WIRE = {
    Reason.GRAMMAR: "response_format",
    Reason.THINKING_BUDGET: "thinking_token_budget",
    Reason.BAD_WORDS: "bad_words",
    Reason.PRESENCE_PENALTY: "presence_penalty",
    Reason.FREQUENCY_PENALTY: "frequency_penalty",
    Reason.REPETITION_PENALTY: "repetition_penalty",
}


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.name)
def test_each_reason_names_its_field_for_a_400(reason: Reason) -> None:
    assert WIRE[reason] in reason.field


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.name)
def test_what_each_reason_asks_of_the_row(reason: Reason) -> None:
    needs = needs_of(params(**GIVEN[reason]))
    # Host-side masks read the last token; penalties count it in the graph.
    host_masks = {Reason.GRAMMAR, Reason.THINKING_BUDGET, Reason.BAD_WORDS}
    assert needs.constrained == (reason in host_masks)
    # A verify pass bars bad words per position; nothing else it reads.
    assert needs.undraftable == (() if reason is Reason.BAD_WORDS else (reason,))


def test_a_plain_request_and_a_logit_bias_need_nothing() -> None:
    plain = needs_of(params(logit_bias=((5, 2.0),), min_tokens=3, top_k=4))
    assert plain == RowNeeds()
    assert not plain.constrained
    assert plain.undraftable == ()


def test_reasons_come_in_one_order_whatever_the_fields() -> None:
    fields = {**GIVEN[Reason.REPETITION_PENALTY], **GIVEN[Reason.BAD_WORDS]}
    fields |= GIVEN[Reason.GRAMMAR]
    needs = needs_of(params(**fields))
    assert needs.reasons == (
        Reason.GRAMMAR,
        Reason.BAD_WORDS,
        Reason.REPETITION_PENALTY,
    )
    assert needs.undraftable == (Reason.GRAMMAR, Reason.REPETITION_PENALTY)


@pytest.mark.parametrize(
    "fields",
    [
        {"thinking_budget": 8},  # the model has no markers
        {"thinking_budget": 8, "thinking_markers": ("<think>", "")},
        {
            "thinking_budget": 8,
            "thinking_markers": MARKERS,
            "grammar": Grammar("regex", "a"),
        },
    ],
    ids=["no-markers", "no-closing-marker", "under-a-grammar"],
)
def test_a_thinking_budget_counts_only_where_it_applies(fields: dict[str, Any]) -> None:
    assert Reason.THINKING_BUDGET not in needs_of(params(**fields)).reasons


class TestRowConstrained:
    def row(self, reason: Reason, **state: Any) -> Row:
        needs = needs_of(params(**GIVEN[reason]))
        return Row(max_tokens=8, sampling=SamplingParams(), needs=needs, **state)

    def test_a_bad_words_row_is_constrained_until_it_is_done(self) -> None:
        row = self.row(Reason.BAD_WORDS)
        assert row.constrained()
        row.done = True
        assert not row.constrained()

    def test_a_penalized_row_is_not(self) -> None:
        assert not self.row(Reason.PRESENCE_PENALTY).constrained()

    def test_a_thinking_budget_constrains_while_the_reasoning_is_open(self) -> None:
        budget = ThinkingBudget(4, opening=(), closing=(7,))
        row = self.row(Reason.THINKING_BUDGET, thinking=budget)
        assert row.constrained()
        budget.observe(7)  # the model closed its reasoning itself
        assert not budget.open
        assert not row.constrained()
        # Still a reason it cannot draft: decided once, from the request.
        assert row.needs.undraftable == (Reason.THINKING_BUDGET,)
