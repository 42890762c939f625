"""LoopTurns: requests ready together share the event loop in slices."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import Any

import anyio
import pytest

from mlx_pinned.server.http.turns import LoopTurns

from .conftest import sse_events, vision_body
from .kit import Serve, content_of

pytestmark = pytest.mark.anyio


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def worker(turns: LoopTurns, pieces: int, done: list[int]) -> None:
    for _ in range(pieces):
        await turns.checkpoint()
        busy(0.0003)
        done.append(1)


async def pieces_before_a_callback(turns: LoopTurns) -> tuple[int, int]:
    """Ten requests of five pieces ready in one loop iteration, then a
    callback queued behind them (what a socket read looks like to the loop):
    how many pieces ran before the callback, and in all."""
    done: list[int] = []
    seen: list[int] = []
    tasks = [asyncio.ensure_future(worker(turns, 5, done)) for _ in range(10)]
    asyncio.get_running_loop().call_soon(lambda: seen.append(len(done)))
    await asyncio.gather(*tasks)
    assert len(seen) == 1
    return seen[0], len(done)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_callback_runs_between_slices() -> None:
    # With a 0.5 ms budget the callback runs after at most two pieces of
    # 0.3 ms; nothing is lost, only sliced.
    turns = LoopTurns(budget=0.0005)
    before, total = await pieces_before_a_callback(turns)
    assert 1 <= before <= 2
    assert total == 50
    assert turns.yields > 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_without_checkpoints_the_callback_waits_for_all() -> None:
    # The control: a budget never used up runs all 50 pieces first.
    turns = LoopTurns(budget=math.inf)
    assert await pieces_before_a_callback(turns) == (50, 50)
    assert turns.yields == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_idle_loop_never_yields() -> None:
    # A lone stream whose pieces come one per loop iteration (the loop waits
    # for each token) starts a new stretch every time: it never yields.
    turns = LoopTurns(budget=0.0005)
    for _ in range(20):
        await turns.checkpoint()
        busy(0.0003)
        await asyncio.sleep(0.001)
    assert turns.yields == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_every_request_gets_its_turn() -> None:
    # Order is kept: a request that yielded runs before it yields again, so
    # each of the ten makes progress in every round of slices.
    turns = LoopTurns(budget=0.0005)
    progress: dict[int, list[int]] = {i: [] for i in range(10)}
    pieces = itertools.count()  # the pieces in the order they ran

    async def tracked(i: int) -> None:
        for _ in range(5):
            await turns.checkpoint()
            busy(0.0003)
            progress[i].append(next(pieces))

    await asyncio.gather(*(tracked(i) for i in range(10)))
    firsts = sorted(p[0] for p in progress.values())
    lasts = sorted(p[-1] for p in progress.values())
    assert firsts[-1] < lasts[0]  # every one started before any one finished
    # Those behind the first in line are not woken each iteration: at most
    # two waits a piece (in line, then first in line for the next stretch);
    # re-checking every waiter each iteration took ~9 a piece.
    assert turns.yields <= 2 * 50


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_request_cancelled_in_line_leaves_it() -> None:
    turns = LoopTurns(budget=0.0005)
    done: list[int] = []
    tasks = [asyncio.ensure_future(worker(turns, 5, done)) for _ in range(4)]
    await asyncio.sleep(0)  # the first runs its slice, then all wait in line
    assert len(turns._line) == 4
    tasks[2].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert tasks[2].cancelled()
    assert len(done) == 15
    assert not turns._line


def test_a_loop_closed_with_its_marker_pending_is_forgotten() -> None:
    # The marker of a loop that closed never runs: the next loop must not
    # take that stretch for its own (its waiters would wait forever).
    turns = LoopTurns(budget=0.0005)
    old = asyncio.new_event_loop()
    turns._open(old)  # the first checkpoint of a stretch, as on that loop
    old.close()
    done: list[int] = []

    async def main() -> None:
        work = asyncio.gather(*(worker(turns, 5, done) for _ in range(4)))
        await asyncio.wait_for(work, timeout=30)

    asyncio.run(main())
    assert len(done) == 20
    assert turns.yields > 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_never_yields() -> None:
    turns = LoopTurns(budget=0.0)
    for _ in range(5):
        await turns.checkpoint()
        busy(0.0003)
    assert turns.yields == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_streams_sliced_to_every_token_lose_nothing(serve: Serve) -> None:
    # The server's streams checkpoint before each event: with a budget of
    # zero every checkpoint that follows another in the same loop iteration
    # yields, and eight concurrent batched streams still get every token.
    async with serve(max_num_seqs=8) as served:
        body = vision_body(6, stream=True, temperature=0)
        solo = content_of(sse_events((await served.chat(body)).text)[:-1])
        turns: LoopTurns = served.app.state.loop_turns
        turns.budget = 0.0
        with anyio.fail_after(60):
            responses = await asyncio.gather(*(served.chat(body) for _ in range(8)))
        assert turns.yields > 0
        for response in responses:
            events: list[Any] = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert content_of(events[:-1]) == solo
