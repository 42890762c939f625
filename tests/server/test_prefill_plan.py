"""The prefill scheduler's decision (``engine/prefill_plan.py``): who
prefills in a step and how many tokens each runs, from plain values."""

from __future__ import annotations

from mlx_pinned.server.engine.prefill_plan import (
    MAX_PARTIAL,
    Limits,
    Plan,
    Waiting,
    plan,
)

LONG = 1000  # a prompt with more left is long


def limits(tokens: int, least: int = 1) -> Limits:
    return Limits(tokens, LONG, least)


class TestBudget:
    def test_a_short_prompt_runs_beside_a_long_one_and_first(self) -> None:
        long, short = Waiting(5000, arrival=1), Waiting(30, arrival=2)
        assert plan([long, short], limits(512)) == Plan(runs=((1, 30), (0, 482)))

    def test_a_second_long_prompt_waits_its_turn(self) -> None:
        first, second = Waiting(5000, arrival=1), Waiting(3000, arrival=2)
        assert plan([first, second], limits(512)) == Plan(runs=((0, 512),))

    def test_prompts_that_do_not_end_share_the_rest_equally(self) -> None:
        waiting = [Waiting(900, arrival=i) for i in range(3)] + [Waiting(10)]
        # A share of 150 each: the short one takes 10, the others share 590.
        got = plan(waiting, limits(600))
        assert dict(got.runs) == {3: 10, 0: 196, 1: 197, 2: 197}
        assert sum(tokens for _, tokens in got.runs) == 600

    def test_a_small_budget_goes_to_fewer_prompts(self) -> None:
        waiting = [Waiting(900, arrival=i) for i in range(4)]
        got = plan(waiting, limits(128, least=64))
        assert got.runs == ((0, 64), (1, 64))

    def test_at_most_a_few_prompts_prefill_at_once(self) -> None:
        waiting = [Waiting(5, arrival=i) for i in range(MAX_PARTIAL + 3)]
        assert len(plan(waiting, limits(4096)).runs) == MAX_PARTIAL

    def test_a_prompt_with_nothing_left_still_runs(self) -> None:
        assert plan([Waiting(0)], limits(64)).runs == ((0, 0),)


class TestOrder:
    def test_priority_then_arrival(self) -> None:
        waiting = [
            Waiting(10, priority=5, arrival=1),
            Waiting(10, priority=-1, arrival=3),
            Waiting(10, priority=-1, arrival=2),
        ]
        assert [i for i, _ in plan(waiting, limits(512)).runs] == [2, 1, 0]

    def test_priority_picks_the_long_prompt_that_runs(self) -> None:
        low, high = Waiting(5000, arrival=1), Waiting(5000, priority=-2, arrival=2)
        assert plan([low, high], limits(512)).runs == ((1, 512),)

    def test_an_abandoned_prompt_runs_after_every_other(self) -> None:
        kept = Waiting(5000, priority=-9, arrival=1, abandoned=True)
        fresh = Waiting(5000, priority=9, arrival=2)
        assert plan([kept, fresh], limits(512)).runs == ((1, 512),)
        assert plan([kept], limits(512)).runs == ((0, 512),)

    def test_a_prompt_others_wait_for_takes_their_priority(self) -> None:
        kept = Waiting(5000, arrival=1, abandoned=True)
        other = Waiting(5000, priority=1, arrival=2)
        waiter = Waiting(5000, priority=0, arrival=3, provider=0)
        got = plan([kept, other, waiter], limits(512))
        assert got.runs == ((0, 512),)  # the waiter is not run itself

    def test_whole_prompts_go_together_in_order(self) -> None:
        waiting = [
            Waiting(20, arrival=1, together=True),
            Waiting(5000, arrival=2),
            Waiting(20, priority=-1, arrival=3, together=True),
        ]
        got = plan(waiting, limits(512))
        assert got == Plan(together=(2, 0), runs=((1, 512),))
