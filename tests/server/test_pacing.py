"""A long prompt's prefill cut by time while other rows decode
(``engine/prefill_plan.py``): smaller chunks then, the same answer."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.prefill_plan import IDLE, MIN_CHUNK, PrefillPacer
from mlx_pinned.server.engine.prompt_cache import PromptCache
from mlx_pinned.server.engine.state import PREFILL_BATCH, BatchState
from mlx_pinned.server.http.served_models import BatchGate

from .kit import (
    PROMPTS,
    TOL,
    WAIT,
    Collector,
    deadline,
    drive_rows,
    max_logprob_difference,
    request,
    solo,
)

pytestmark = pytest.mark.anyio

# About 650 prompt tokens with the tiny tokenizer: three chunks of 256.
LONG = " ".join(PROMPTS * 4)
STEP = 256


class TestPacer:
    def test_no_budget_gives_the_cap(self) -> None:
        assert PrefillPacer(None, 512).tokens(decoding=True) == 512
        assert PrefillPacer(None, 512).tokens(decoding=False) == 512

    def test_a_chunk_nobody_waits_on_takes_longer(self) -> None:
        paced = PrefillPacer(0.1, 4096)
        paced.observe(100, 0.1)  # 1 ms a token
        assert paced.tokens(decoding=True) == 100
        assert paced.tokens(decoding=False) == IDLE * 100

    def test_the_first_chunk_learns_the_cost(self) -> None:
        assert PrefillPacer(0.1, 4096).tokens(decoding=True) == MIN_CHUNK
        assert PrefillPacer(0.1, 16).tokens(decoding=True) == 16

    def test_chunks_take_the_budget_at_the_last_cost(self) -> None:
        pacer = PrefillPacer(0.05, 4096)
        pacer.observe(100, 0.01)  # 0.1 ms a token
        assert pacer.tokens(decoding=True) == 500
        pacer.observe(500, 0.1)  # dearer further in: 0.2 ms a token
        assert pacer.tokens(decoding=True) == 250
        pacer.observe(250, 10.0)  # far over: never under the floor
        assert pacer.tokens(decoding=True) == MIN_CHUNK
        pacer.observe(100, 1e-6)  # far under: never over the cap
        assert pacer.tokens(decoding=True) == 4096

    def test_a_step_is_spent_at_the_budget(self) -> None:
        paced = PrefillPacer(0.1, 512)
        assert not paced.spent(0.05)
        assert paced.spent(0.1)
        assert not PrefillPacer(None, 512).spent(5.0)


async def test_prompts_from_the_cache_share_a_step_within_its_time(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    """While a row decodes, prompts that start from the prompt cache share
    a step's chunk: a prefill batch's worth in one step, or with a budget
    that one pass spends, one a step."""

    def left_after_a_step(seconds: float | None, prompts: int = 6) -> int:
        state = BatchState(loaded, PromptCache(2**26), prefill_seconds=seconds)
        drive_rows(state, [request(1, 2, sizes=(None,))], [0])  # now cached
        state.admit(*request(0, 40, sizes=(None,)))
        state.step()  # its prefill
        state.step()  # it decodes
        for _ in range(prompts):
            state.admit(*request(1, 4, sizes=(None,)))
        state.step()
        return len(state.prefills)

    assert await thread.run(left_after_a_step, None) == 0
    assert await thread.run(left_after_a_step, 1e-9) == 5
    # A prefill batch's worth a step: each joins the batch alone.
    assert await thread.run(left_after_a_step, None, PREFILL_BATCH + 3) == 3


async def test_a_short_prompt_goes_in_beside_a_long_one(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    """A prompt from the cache (a few tokens left) and a long one share a
    step's tokens: the short one ends in it, the long one runs the rest."""

    def after_a_step() -> tuple[bool, int, int, int]:
        state = BatchState(loaded, PromptCache(2**26), prefill_step=STEP)
        drive_rows(state, [request(1, 2, sizes=(None,))], [0])  # now cached
        long = state.admit(*request(0, 4, prompts=(LONG,), sizes=(None,)))
        short = state.admit(*request(1, 4, sizes=(None,)))
        assert short.prepared is not None
        short_left = short.prepared.prompt_tokens - 1
        state.step()
        ((row, job),) = state.prefilling
        assert row is long
        ran = job.position - long.cached
        return bool(short.pending), short_left - short.cached, ran, STEP

    ended, short_ran, long_ran, step = await thread.run(after_a_step)
    assert ended
    assert long_ran == step - short_ran


async def passes_with(
    thread: MLXThread, loaded: LoadedModel, seconds: float | None
) -> tuple[int, list[list]]:  # type: ignore[type-arg]
    """A stream decodes; a long prompt arrives. The long prompt's prefill
    passes, and both answers' events."""
    running = request(0, 48, top_logprobs=2)
    long = request(1, 6, prompts=(LONG,), sizes=(None,), top_logprobs=2)
    batch = BatchEngine(
        loaded, thread, prefill_step_size=STEP, prefill_step_seconds=seconds
    )
    gate = BatchGate(max_num_seqs=2, max_pending=0)
    runs = [Collector(thread, batch, gate, req) for req in (running, long)]
    # Two tokens in, the loop steps no further until the long prompt is
    # submitted: it arrives then, however slow the event loop is.
    submitted = threading.Event()
    turn, submit = batch.loop.turn, batch.loop.submit

    def turning() -> Any:
        if batch.statistics().decoded_tokens >= 2:
            submitted.wait(WAIT)
        return turn()

    def submitting(request: Any) -> None:
        submit(request)
        if runs[1].started.is_set():
            submitted.set()

    batch.loop.turn = turning  # type: ignore[method-assign]
    batch.loop.submit = submitting  # type: ignore[method-assign]
    async with deadline() as group:
        group.start_soon(runs[0].run)
        await runs[0].two_tokens.wait()
        group.start_soon(runs[1].run)
    stats = batch.statistics()
    assert (stats.peak_active, stats.prefills) == (2, 2)
    return stats.prefill_passes - 1, [run.events for run in runs]


@pytest.mark.slow
async def test_a_long_prompt_is_cut_by_time_while_a_stream_decodes(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    running = request(0, 48, top_logprobs=2)
    long = request(1, 6, prompts=(LONG,), sizes=(None,), top_logprobs=2)
    alone = [await solo(thread, loaded, req) for req in (running, long)]
    by_tokens, plain = await passes_with(thread, loaded, None)
    # A budget no chunk can meet: every chunk is the floor's size.
    by_time, paced = await passes_with(thread, loaded, 1e-6)
    assert by_tokens == 3
    assert by_time >= 2 * by_tokens
    for events in (plain, paced):
        for got, expected in zip(events, alone, strict=True):
            assert max_logprob_difference(got, expected) <= TOL


async def test_a_long_prompt_alone_is_cut_by_time_too(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    # Nobody waits on its chunks: IDLE budgets each, the floor's size here.
    long = request(1, 4, prompts=(LONG,), sizes=(None,), top_logprobs=2)
    batch = BatchEngine(
        loaded, thread, prefill_step_size=STEP, prefill_step_seconds=1e-6
    )
    gate = BatchGate(max_num_seqs=1, max_pending=0)
    run = Collector(thread, batch, gate, long)
    async with deadline() as group:
        group.start_soon(run.run)
    assert batch.statistics().prefill_passes > 3
    assert max_logprob_difference(run.events, await solo(thread, loaded, long)) <= TOL
