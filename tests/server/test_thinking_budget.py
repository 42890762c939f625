"""A thinking budget forces the reasoning's closing marker after N tokens.

Engine level, on the tiny model: a budgeted row writes N tokens of its own,
then the closing marker's tokens one per step, then goes on freely; a row
without a budget is what it was, alone or batched with budgeted rows; a
budgeted row batched with others equals itself alone. Through the doors:
each one's field maps to the budget, and the answer's reasoning has exactly
the budget's tokens.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.thinking_budget import ThinkingBudget
from mlx_pinned.server.http.anthropic_messages.protocol import (
    parse_messages_request,
)
from mlx_pinned.server.http.chat_completions.protocol import parse_chat_request
from mlx_pinned.server.http.protocol_common import EFFORT_BUDGETS
from mlx_pinned.server.http.responses_api.protocol import parse_responses_request
from mlx_pinned.server.http.served_models import BatchGate

from .conftest import MODEL
from .kit import (
    TOL,
    Collector,
    Event,
    Request,
    Serve,
    deadline,
    max_logprob_difference,
    request,
    solo,
    tokens,
)

pytestmark = pytest.mark.anyio

OPENED = ("", "</think>")  # a template that opens <think> itself


def text_request(index: int, max_tokens: int, **params: Any) -> Request:
    return request(index, max_tokens, sizes=[None], top_logprobs=2, **params)


async def batched(
    thread: MLXThread, loaded: LoadedModel, reqs: list[Request]
) -> list[list[Event]]:
    """The requests' events, batched together on one engine."""
    batch = BatchEngine(loaded, thread)
    gate = BatchGate(max_num_seqs=len(reqs), max_pending=len(reqs))
    runs = [Collector(thread, batch, gate, req) for req in reqs]
    async with deadline() as group:
        for run in runs:
            group.start_soon(run.run)
    return [run.events for run in runs]


def ids(events: list[Event]) -> list[str]:
    """The answer's tokens (as the log-probabilities name them)."""
    out = []
    for event in tokens(events):
        assert event.logprobs is not None
        out.append(event.logprobs.token)
    return out


def closing_ids(loaded: LoadedModel) -> list[int]:
    found: list[int] = loaded.tokenizer.encode("</think>", add_special_tokens=False)
    assert found
    return found


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 3, 7])
async def test_budget_gives_n_tokens_then_the_closing_marker(
    thread: MLXThread, loaded: LoadedModel, budget: int
) -> None:
    free, capped = await batched(
        thread,
        loaded,
        [
            text_request(3, 16),
            text_request(3, 16, thinking_budget=budget, thinking_markers=OPENED),
        ],
    )
    closing = closing_ids(loaded)
    free_ids, capped_ids = ids(free), ids(capped)
    assert "</think>" not in "".join(free_ids)  # the model never closes
    assert capped_ids[:budget] == free_ids[:budget]
    assert capped_ids[budget] != free_ids[budget]
    assert "".join(capped_ids[budget : budget + len(closing)]) == "</think>"
    forced = tokens(capped)[budget : budget + len(closing)]
    assert all(e.logprobs is not None and e.logprobs.logprob == 0 for e in forced)
    # Then the row goes on, sampling freely (a greedy row: its argmax).
    assert len(capped_ids) == 16
    after = tokens(capped)[budget + len(closing) :]
    for event in after:
        assert event.logprobs is not None
        assert event.logprobs.token == max(event.logprobs.top, key=lambda t: t[1])[0]


@pytest.mark.slow
async def test_no_budget_is_unchanged_alone_and_beside_budgeted_rows(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    plain = [text_request(i, 14) for i in range(3)]
    alone = [await solo(thread, loaded, req) for req in plain]
    marked = text_request(0, 14, thinking_markers=OPENED)  # markers, no budget
    (only,) = await batched(thread, loaded, [marked])
    assert max_logprob_difference(only, alone[0]) == 0.0
    capped = [
        text_request(i, 14, thinking_budget=2 + i, thinking_markers=OPENED)
        for i in range(3, 5)
    ]
    mixed = await batched(thread, loaded, [*plain, *capped])
    for events, expected in zip(mixed[:3], alone, strict=True):
        assert max_logprob_difference(events, expected) <= TOL


async def test_budgeted_rows_batched_equal_themselves_alone(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    reqs = [
        text_request(i, 12 + i, thinking_budget=i, thinking_markers=OPENED)
        for i in range(4)
    ]
    reqs.append(text_request(5, 10))
    alone = [(await batched(thread, loaded, [req]))[0] for req in reqs]
    together = await batched(thread, loaded, reqs)
    for events, expected in zip(together, alone, strict=True):
        assert max_logprob_difference(events, expected) <= TOL


async def test_reasoning_the_model_never_opens_is_never_forced(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    free, capped = await batched(
        thread,
        loaded,
        [
            text_request(2, 10),
            text_request(
                2, 10, thinking_budget=1, thinking_markers=("<think>", "</think>")
            ),
        ],
    )
    assert ids(capped) == ids(free)


async def test_a_chat_budget_gives_reasoning_of_n_tokens_then_content(
    serve: Serve,
) -> None:
    budget, max_tokens = 5, 24
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        # The tiny template opens <think> under enable_thinking.
        "chat_template_kwargs": {"enable_thinking": True},
        "thinking_token_budget": budget,
    }
    async with serve() as served:
        answer = await served.chat(body)
        assert answer.status_code == 200, answer.text
        closing = len(closing_ids(served.model))
    choice = answer.json()["choices"][0]
    pieces = [t["token"] for t in choice["logprobs"]["content"]]
    assert len(pieces) == max_tokens
    assert "".join(pieces[budget : budget + closing]) == "</think>"
    message = choice["message"]
    assert message["reasoning_content"] == "".join(pieces[:budget]).strip("\n")
    assert message["content"] == "".join(pieces[budget + closing :]).lstrip("\n")
    assert message["content"]


@pytest.mark.slow
async def test_an_anthropic_budget_ends_the_thinking_block(serve: Serve) -> None:
    budget = 1024  # Anthropic's least
    body = {
        "model": MODEL,
        "max_tokens": budget + 24,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": budget},
    }
    async with serve() as served:
        answer = await served.client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    blocks = answer.json()["content"]
    # The tiny model never closes its thinking itself: the budget closed it.
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"]
    assert blocks[1]["text"]


def test_each_doors_field_maps_to_its_budget() -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(json.dumps(chat).encode()).thinking_budget is None
    for effort, tokens_ in EFFORT_BUDGETS.items():
        body = {**chat, "reasoning_effort": effort}
        assert parse_chat_request(json.dumps(body).encode()).thinking_budget == tokens_
        answers = {"model": MODEL, "input": "hi", "reasoning": {"effort": effort}}
        parsed = parse_responses_request(json.dumps(answers).encode())
        assert parsed.thinking_budget == tokens_
    both = {**chat, "reasoning_effort": "high", "thinking_token_budget": 7}
    assert parse_chat_request(json.dumps(both).encode()).thinking_budget == 7
    assert (EFFORT_BUDGETS["low"], EFFORT_BUDGETS["high"]) == (1024, 16384)
    anthropic = {
        "model": MODEL,
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    thinking = parse_messages_request(json.dumps(anthropic).encode()).thinking
    assert getattr(thinking, "budget_tokens", None) == 2048


def steps(budget: ThinkingBudget, written: list[int]) -> list[int | None]:
    """What the budget forces before each of ``written``, fed one by one
    (a forced token is written as forced)."""
    forced = []
    for token in written:
        wanted = budget.next_forced()
        forced.append(wanted)
        budget.observe(token if wanted is None else wanted)
    return forced


def test_the_budget_counts_from_the_opening_marker() -> None:
    budget = ThinkingBudget(2, opening=[1, 2], closing=[8, 9])
    # Opens (1, 2), thinks 5 and 6, then 8 and 9 are forced, then free.
    assert steps(budget, [1, 2, 5, 6, 0, 0, 7, 7]) == [
        *[None] * 4, 8, 9, None, None,
    ]  # fmt: skip
    assert budget.thought == 2
    assert not budget.open


def test_a_reasoning_closed_or_never_opened_is_not_forced() -> None:
    closed = ThinkingBudget(3, opening=[], closing=[8, 9])
    assert steps(closed, [5, 8, 9, 5, 5, 5, 5]) == [None] * 7
    assert not closed.open
    unopened = ThinkingBudget(0, opening=[1, 2], closing=[8, 9])
    assert steps(unopened, [1, 5, 1, 2, 5]) == [None] * 5
    assert not unopened.open
    at_once = ThinkingBudget(0, opening=[], closing=[8, 9])
    assert steps(at_once, [5, 5, 5]) == [8, 9, None]
