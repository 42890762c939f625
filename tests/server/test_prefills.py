"""The prompts in prefill (``engine/prefills.py``), stepped by hand and
counted in steps and tokens: a short prompt goes in beside a long one,
priority orders the budget, a prompt that shares a prefix with one in
prefill waits for it and takes it from the prompt cache, and a prefill
whose client left is kept for a retry. Every answer equals the same
request's with the cache off (log-probabilities within 1e-5)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.prompt_cache import PromptCache
from mlx_pinned.server.engine.rows import Row
from mlx_pinned.server.engine.state import BatchState
from mlx_pinned.testing import tiny_vlm_path

from .kit import (
    PROMPTS,
    TOL,
    Request,
    hold_until,
    max_logprob_difference,
    request,
    solo,
)

pytestmark = pytest.mark.anyio

STEP = 128
# About 650 prompt tokens with the tiny tokenizer: several chunks of STEP.
LONG = " ".join(PROMPTS * 4)
OTHER = " ".join(reversed(PROMPTS * 4))


def long_request(text: str = LONG, **params: Any) -> Request:
    return request(0, 4, prompts=(text,), sizes=(None,), top_logprobs=2, **params)


def short_request(index: int = 1, **params: Any) -> Request:
    return request(index, 4, sizes=(None,), top_logprobs=2, **params)


def batch(loaded: LoadedModel, **settings: Any) -> BatchState:
    return BatchState(loaded, PromptCache(2**26), prefill_step=STEP, **settings)


def until(state: BatchState, done: Callable[[], bool], limit: int = 200) -> int:
    """Step ``state`` until ``done()``; the steps it took."""
    for steps in range(1, limit + 1):
        state.step()
        if done():
            return steps
    raise AssertionError(f"not done after {limit} steps")


def finish(state: BatchState, rows: list[Row]) -> None:
    until(state, lambda: all(r.done for r in rows) and state.idle())


def first(row: Row) -> bool:
    return row.sampled > 0


class TestShortBesideLong:
    def test_a_short_prompt_starts_within_a_step(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        def go() -> tuple[int, int]:
            state = batch(loaded)
            long = state.admit(*long_request())
            state.step()  # its first chunk
            short = state.admit(*short_request())
            steps = until(state, lambda: first(short))
            left = state.prefilling[0][1].left if state.prefilling else 0
            finish(state, [long, short])
            return steps, left

        steps, left = thread.run_sync(go)
        assert steps == 1
        assert left > 0  # the long one still prefills

    def test_a_second_long_prompt_waits_for_the_first(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        """Until the first has no more than a chunk left: then it is short, and
        the second goes in beside it."""

        def go() -> list[tuple[int, int]]:
            state = batch(loaded)
            one = state.admit(*long_request())
            two = state.admit(*long_request(OTHER))
            seen = []
            while not first(one):
                state.step()
                jobs = dict(state.prefilling)
                if one in jobs:
                    left = jobs[one].left
                    seen.append((left, jobs[two].position if two in jobs else 0))
            finish(state, [one, two])
            return seen

        seen = thread.run_sync(go)
        assert len(seen) >= 4
        assert all(second == 0 for left, second in seen if left > STEP + 1)

    def test_each_chunk_moves_the_progress_it_reports(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        """``Row.prefilled``, which ``return_progress`` streams, grows with
        every chunk until the prompt is in, before the first token."""

        def go() -> tuple[list[int], int]:
            state = batch(loaded)
            row = state.admit(*long_request())
            seen = []
            while not first(row):
                state.step()
                seen.append(row.prefilled)
            finish(state, [row])
            return seen, row.prompt_tokens

        seen, total = thread.run_sync(go)
        assert len(seen) >= 3  # several chunks
        assert seen == sorted(set(seen))  # each step moved it
        assert 0 < seen[0] < total - 1
        # The last token runs in the pass that samples the first: the
        # progress reports the whole prompt once that is in.
        assert seen[-1] == total - 1

    def test_priority_orders_the_budget(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        def go() -> list[str]:
            state = batch(loaded)
            low = state.admit(*long_request(priority=5))
            high = state.admit(*long_request(OTHER, priority=-5))
            order: list[str] = []
            while len(order) < 2:
                state.step()
                for name, row in (("low", low), ("high", high)):
                    if first(row) and name not in order:
                        order.append(name)
            finish(state, [low, high])
            return order

        assert thread.run_sync(go) == ["high", "low"]


class TestOnePrefillForOnePrefix:
    def test_identical_prompts_prefill_once(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        req = long_request()

        def go() -> tuple[int, int, int]:
            state = batch(loaded)
            one, two = state.admit(*req), state.admit(*req)
            until(state, lambda: first(one))
            steps = until(state, lambda: first(two))
            finish(state, [one, two])
            return two.cached, two.prompt_tokens, steps

        cached, prompt_tokens, steps = thread.run_sync(go)
        assert cached == prompt_tokens - 1
        assert steps <= 2  # it starts once the first one's prefill is cached

    async def test_a_shared_prefix_is_prefilled_once(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        """Two prompts that share a long start: the second waits for the first
        to reach the point where they differ, and resumes from there."""
        one = long_request(LONG + " Tell me about the sea.")
        two = long_request(LONG + " Now the mountains, please.")

        def go() -> tuple[int, int]:
            state = batch(loaded)
            rows = [state.admit(*one), state.admit(*two)]
            finish(state, rows)
            ids = [r.key for r in rows]
            assert ids[0] is not None
            assert ids[1] is not None
            pairs = zip(*ids, strict=False)
            shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
            return rows[1].cached, shared

        cached, shared = await thread.run(go)
        assert cached == shared
        engine_ = BatchEngine(loaded, thread, prompt_cache_bytes=2**26)
        expected = await solo(thread, loaded, two)
        got = await collect(engine_, [one, two])
        assert max_logprob_difference(got[1], expected) <= TOL

    async def test_a_model_with_states_shares_at_a_checkpoint(
        self, thread: MLXThread
    ) -> None:
        hybrid = await thread.run(engine.load, tiny_vlm_path("qwen3_5"))
        one = long_request(LONG + " Tell me about the sea.")
        two = long_request(LONG + " Now the mountains, please.")
        on = BatchEngine(
            hybrid, thread, prompt_cache_bytes=2**26, prefill_step_size=STEP
        )
        off = BatchEngine(hybrid, thread)
        expected = [await collect(off, [req]) for req in (one, two)]
        # Both admitted in one turn, whatever the load: one waits for the
        # other's prefill to reach where they differ.
        held = hold_until(thread, lambda: on.loop.queued() == 2)
        got = await collect(on, [one, two])
        held.result()
        for ours, theirs in zip(got, expected, strict=True):
            assert max_logprob_difference(ours, theirs[0]) <= TOL
        # Which of the two goes first is the event loop's choice (trio's
        # varies): the other takes the shared start from a checkpoint.
        assert max(events[-1].cached_tokens for events in got) > 500


async def collect(engine_: BatchEngine, reqs: list[Request]) -> list[list[Any]]:
    """``reqs`` submitted together; each one's events."""
    import anyio

    out: list[list[Any]] = [[] for _ in reqs]

    async def one(i: int) -> None:
        async with engine_.stream(*reqs[i]) as stream:
            out[i] = [event async for event in stream]

    async with anyio.create_task_group() as group:
        for i in range(len(reqs)):
            group.start_soon(one, i)
    return out


class TestAbandoned:
    def kept(
        self, loaded: LoadedModel, bound: int, leave_after: int
    ) -> tuple[int, int]:
        """A long prompt whose client leaves after ``leave_after`` steps, then
        the same prompt again: its cached tokens, and its prompt's."""
        state = batch(loaded, abandoned_tokens=bound)
        gone = state.admit(*long_request())
        for _ in range(leave_after):
            state.step()
        state.leave(gone)
        until(state, state.idle)
        again = state.admit(*long_request())
        finish(state, [again])
        return again.cached, again.prompt_tokens

    def test_it_finishes_for_a_retry(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        cached, prompt_tokens = thread.run_sync(self.kept, loaded, 10**6, 2)
        assert cached == prompt_tokens - 1

    def test_past_the_bound_it_stops(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        cached, _ = thread.run_sync(self.kept, loaded, STEP, 1)
        assert cached < STEP

    def test_a_retry_meanwhile_waits_for_it(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        def go() -> tuple[int, int, bool]:
            state = batch(loaded, abandoned_tokens=10**6)
            gone = state.admit(*long_request())
            state.step()
            state.leave(gone)
            again = state.admit(*long_request())
            finish(state, [again])
            return again.cached, again.prompt_tokens, bool(gone.pending)

        cached, prompt_tokens, handed = thread.run_sync(go)
        assert cached == prompt_tokens - 1
        assert not handed  # the abandoned row's first token is never sampled

    async def test_the_retry_gets_the_same_answer(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        req = long_request()
        make = functools.partial(BatchState, abandoned_tokens=10**6)
        on = BatchEngine(
            loaded,
            thread,
            prompt_cache_bytes=2**26,
            prefill_step_size=STEP,
            make_state=make,
        )
        loop = on.loop

        def leave_after_a_chunk() -> None:
            from mlx_pinned.server.engine.answers import Request as Admission

            admission = Admission(*req)
            loop.submit(admission)
            loop.turn()
            loop.turn()
            loop.leave(admission)
            while not on._state.idle() or loop.waiting():
                loop.turn()

        await thread.run(leave_after_a_chunk)
        (got,) = await collect(on, [req])
        assert got[-1].cached_tokens == got[-1].prompt_tokens - 1
        assert max_logprob_difference(got, await solo(thread, loaded, req)) <= TOL
