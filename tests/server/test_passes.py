"""The encoder kinds' loop (engine/passes.py): inputs of every waiting
request share a pass, in arrival order; a pass is bounded by its padded
tokens, its inputs and its time; other streams of the thread run between
passes; a cancelled request leaves the queue; a failed pass fails its own
requests only; the loop starts with a request and ends when idle. The pass
here is a plain function on the MLX thread (its cost is a sleep per padded
token), so the bounds are exact. Where requests must meet in one turn, the
thread is held until they all wait."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from mlx_pinned import CHECKPOINT, MLXThread, MLXThreadClosedError
from mlx_pinned.server.engine.passes import Encoded, PassDriver, PassLoop, padded

pytestmark = pytest.mark.anyio

PER_TOKEN = 2e-4  # seconds the pass below takes per padded token


class Passes:
    """A pass that records each batch and answers each input's first id.

    Args:
        fail_on: A pass with an input that starts with this id raises.
        block_on: The pass of this number (from 1) sets ``entered`` and
            waits for ``release``.
        log: Gets "pass" at each pass.
    """

    def __init__(
        self,
        *,
        fail_on: int | None = None,
        block_on: int | None = None,
        log: list[str] | None = None,
    ) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.block_on = block_on
        self.entered = threading.Event()
        self.release = threading.Event()
        self.log = log

    def __call__(self, batch: Sequence[Encoded]) -> np.ndarray:
        self.batches.append([item.ids[0] for item in batch])
        if self.log is not None:
            self.log.append("pass")
        if len(self.batches) == self.block_on:
            self.entered.set()
            self.release.wait()
        ids, _, _ = padded(batch, 0)
        time.sleep(ids.size * PER_TOKEN)
        if self.fail_on is not None and any(i.ids[0] == self.fail_on for i in batch):
            raise RuntimeError("the pass broke")
        return ids[:, :1].astype(np.float32)

    @property
    def ran(self) -> int:
        """Inputs run so far."""
        return sum(len(batch) for batch in self.batches)


class CountedLoop(PassLoop):
    """A loop that counts its starts (each stream of it)."""

    def __init__(self, forward: Passes, **passes: Any) -> None:
        super().__init__(forward, **passes)
        self.starts = 0

    def run(self) -> Any:
        self.starts += 1
        return super().run()


@pytest.fixture
async def thread() -> AsyncIterator[MLXThread]:
    mlx_thread = MLXThread(name="passes")
    try:
        yield mlx_thread
    finally:
        mlx_thread.shutdown()


def driver_of(
    thread: MLXThread, forward: Passes, **passes: Any
) -> tuple[CountedLoop, PassDriver]:
    loop = CountedLoop(forward, **passes)
    return loop, PassDriver(loop, thread)


@contextmanager
def held(thread: MLXThread) -> Iterator[None]:
    """The MLX thread busy until the block ends: what is submitted in it
    meets in the loop's first turn."""
    release = threading.Event()
    thread.submit(release.wait)
    try:
        yield
    finally:
        release.set()


def inputs(first: int, count: int, length: int = 4) -> list[Encoded]:
    return [Encoded([first + n] * length) for n in range(count)]


def firsts(rows: Sequence[np.ndarray]) -> list[float]:
    return [float(row[0]) for row in rows]


def test_padded_pads_on_the_right_and_masks() -> None:
    ids, mask, types = padded([Encoded([5, 6, 7]), Encoded([8], [1])], 0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert types.tolist() == [[0, 0, 0], [1, 0, 0]]


async def test_each_request_gets_its_own_rows_in_order(thread: MLXThread) -> None:
    _, driver = driver_of(thread, Passes())
    assert firsts(await driver.rows(inputs(10, 5))) == [10, 11, 12, 13, 14]
    assert await driver.rows([]) == []


class TestLifecycle:
    async def test_the_loop_starts_with_a_request_and_ends_when_idle(
        self, thread: MLXThread
    ) -> None:
        loop, driver = driver_of(thread, Passes())
        assert (loop.starts, driver.running) == (0, False)
        assert firsts(await driver.rows(inputs(10, 3))) == [10, 11, 12]
        # Its last outputs are handed over once its stream ended.
        assert (loop.starts, driver.running) == (1, False)
        assert thread.statistics().open_streams == 0

    async def test_the_next_request_starts_it_again(self, thread: MLXThread) -> None:
        loop, driver = driver_of(thread, Passes())
        await driver.rows(inputs(10, 3))
        assert firsts(await driver.rows(inputs(20, 2))) == [20, 21]
        assert (loop.starts, driver.running) == (2, False)
        assert (driver.pending, thread.statistics().open_streams) == (0, 0)

    async def test_requests_that_come_while_it_runs_join_it(
        self, thread: MLXThread
    ) -> None:
        forward = Passes()
        loop, driver = driver_of(thread, forward, batch_size=64)
        answers: dict[int, list[float]] = {}

        async def one(first: int) -> None:
            answers[first] = firsts(await driver.rows(inputs(first, 2)))

        async with anyio.create_task_group() as tasks:
            with held(thread):
                for first in (100, 200, 300):
                    tasks.start_soon(one, first)
                    await anyio.wait_all_tasks_blocked()  # in this order
                assert (driver.pending, driver.running) == (6, True)
        assert answers == {f: [f, f + 1] for f in (100, 200, 300)}
        assert loop.starts == 1
        assert forward.batches == [[100, 101, 200, 201, 300, 301]]

    async def test_a_closed_thread_refuses_at_once(self, thread: MLXThread) -> None:
        loop, driver = driver_of(thread, Passes())
        thread.shutdown()
        with pytest.raises(MLXThreadClosedError):
            await driver.rows(inputs(0, 2))
        assert (driver.pending, driver.running, loop.starts) == (0, False, 0)

    async def test_a_thread_closed_under_it_fails_its_requests(
        self, thread: MLXThread
    ) -> None:
        forward = Passes(block_on=1)
        _, driver = driver_of(thread, forward, batch_size=1)
        failed: list[BaseException] = []

        async def one() -> None:
            try:
                await driver.rows(inputs(0, 3))
            except Exception as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(one)
            await anyio.to_thread.run_sync(forward.entered.wait)
            thread.shutdown(wait=False)
            forward.release.set()
        assert [type(exc) for exc in failed] == [MLXThreadClosedError]
        assert (driver.pending, driver.running, forward.ran) == (0, False, 1)


async def test_concurrent_requests_share_passes_in_arrival_order(
    thread: MLXThread,
) -> None:
    forward = Passes()
    _, driver = driver_of(thread, forward, batch_size=8)
    answers: dict[int, list[float]] = {}

    async def one(first: int) -> None:
        answers[first] = firsts(await driver.rows(inputs(first, 3)))

    async with anyio.create_task_group() as tasks:
        with held(thread):
            for first in (100, 200, 300, 400):
                tasks.start_soon(one, first)
                await anyio.wait_all_tasks_blocked()  # in this order
    assert answers == {f: [f, f + 1, f + 2] for f in (100, 200, 300, 400)}
    # In arrival order: each request's inputs together, in its order.
    assert forward.batches == [
        [100, 101, 102, 200, 201, 202, 300, 301],
        [302, 400, 401, 402],
    ]


@pytest.mark.slow
async def test_a_pass_holds_at_most_its_tokens_and_its_time(
    thread: MLXThread,
) -> None:
    forward = Passes()
    _, unpaced = driver_of(thread, forward, batch_tokens=40, batch_size=64)
    await unpaced.rows(inputs(0, 30))
    assert max(len(b) * 4 for b in forward.batches) <= 40
    forward.batches.clear()
    # About 0.02 s a pass: at most 0.02 / PER_TOKEN = 100 padded tokens once
    # the first pass measured the cost (the sleep is never shorter).
    _, paced = driver_of(thread, forward, batch_size=64, seconds=0.02)
    await paced.rows(inputs(0, 200))
    sizes = [len(batch) * 4 for batch in forward.batches[1:]]
    assert max(sizes) <= 100
    assert len(forward.batches) >= 200 * 4 // 100


async def test_a_long_input_is_one_pass_alone(thread: MLXThread) -> None:
    forward = Passes()
    _, driver = driver_of(thread, forward, batch_tokens=16)
    rows = await driver.rows([Encoded([1] * 40), Encoded([2])])
    assert firsts(rows) == [1, 2]
    assert forward.batches == [[1], [2]]


async def test_other_streams_of_the_thread_run_between_passes(
    thread: MLXThread,
) -> None:
    log: list[str] = []
    forward = Passes(log=log)
    _, driver = driver_of(thread, forward, batch_size=2)

    def other() -> Iterator[object]:  # a chat model's loop, say
        while forward.ran < 20:
            log.append("step")
            yield CHECKPOINT

    async def follow() -> None:
        async for _ in thread.iterate(other):
            pass

    async with anyio.create_task_group() as tasks:
        with held(thread):
            tasks.start_soon(follow)
            tasks.start_soon(driver.rows, inputs(0, 20))
            await anyio.wait_all_tasks_blocked()
    assert log.count("pass") == 10
    assert ["pass", "pass"] not in [log[at : at + 2] for at in range(len(log))]


async def test_a_cancelled_request_leaves_the_queue(thread: MLXThread) -> None:
    forward = Passes(block_on=2)
    _, driver = driver_of(thread, forward, batch_size=4)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(driver.rows, inputs(0, 400))
        await anyio.to_thread.run_sync(forward.entered.wait)
        tasks.cancel_scope.cancel()  # while its second pass runs
    assert driver.pending == 0
    forward.release.set()
    assert firsts(await driver.rows(inputs(1000, 2))) == [1000, 1001]
    # Its inputs after the second pass never ran.
    assert forward.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [1000, 1001]]
    assert (driver.pending, driver.running) == (0, False)


async def test_a_failed_pass_fails_the_requests_in_it_and_no_other(
    thread: MLXThread,
) -> None:
    forward = Passes(fail_on=7)
    _, driver = driver_of(thread, forward, batch_size=3)
    answers: dict[int, list[float] | str] = {}

    async def one(first: int) -> None:
        try:
            answers[first] = firsts(await driver.rows(inputs(first, 2)))
        except RuntimeError as exc:
            answers[first] = str(exc)

    async with anyio.create_task_group() as tasks:
        with held(thread):
            for first in (1, 7, 20):
                tasks.start_soon(one, first)
                await anyio.wait_all_tasks_blocked()
    # 1, 2 and 7 share the failed pass; 8 never runs; 20 and 21 do.
    assert forward.batches == [[1, 2, 7], [20, 21]]
    assert answers == {1: "the pass broke", 7: "the pass broke", 20: [20, 21]}
    assert driver.pending == 0
