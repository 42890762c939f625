"""The encoder kinds' shared passes (engine/passes.py): inputs of every
waiting request share a pass, in arrival order; a pass is bounded by its
padded tokens, its inputs and its time; a cancelled request leaves the
queue; a failed pass fails its own requests only. The pass here is a plain
function on the MLX thread (its cost is a sleep per padded token), so the
bounds are exact."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine.passes import Encoded, PassQueue, padded

pytestmark = pytest.mark.anyio

PER_TOKEN = 2e-4  # seconds the pass below takes per padded token


class Passes:
    """A pass that records each batch and answers each input's first id."""

    def __init__(self, *, fail_on: int | None = None) -> None:
        self.batches: list[list[Encoded]] = []
        self.fail_on = fail_on

    def __call__(self, batch: Sequence[Encoded]) -> np.ndarray:
        self.batches.append(list(batch))
        ids, _, _ = padded(batch, 0)
        time.sleep(ids.size * PER_TOKEN)
        if self.fail_on is not None and any(i.ids[0] == self.fail_on for i in batch):
            raise RuntimeError("the pass broke")
        return ids[:, :1].astype(np.float32)


@pytest.fixture
async def thread() -> AsyncIterator[MLXThread]:
    mlx_thread = MLXThread(name="passes")
    try:
        yield mlx_thread
    finally:
        mlx_thread.shutdown()


def inputs(first: int, count: int, length: int = 4) -> list[Encoded]:
    return [Encoded([first + n] * length) for n in range(count)]


def test_padded_pads_on_the_right_and_masks() -> None:
    ids, mask, types = padded([Encoded([5, 6, 7]), Encoded([8], [1])], 0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert types.tolist() == [[0, 0, 0], [1, 0, 0]]


async def test_each_request_gets_its_own_rows_in_order(thread: MLXThread) -> None:
    forward = Passes()
    queue = PassQueue(thread, forward)
    rows = await queue.run(inputs(10, 5))
    assert [float(row[0]) for row in rows] == [10, 11, 12, 13, 14]


@pytest.mark.slow
async def test_concurrent_requests_share_passes_in_arrival_order(
    thread: MLXThread,
) -> None:
    forward = Passes()
    queue = PassQueue(thread, forward, batch_size=8)
    answers: dict[int, list[float]] = {}

    async def one(first: int) -> None:
        answers[first] = [float(row[0]) for row in await queue.run(inputs(first, 3))]

    async with anyio.create_task_group() as tasks:
        for first in (100, 200, 300, 400):
            tasks.start_soon(one, first)
    assert answers == {f: [f, f + 1, f + 2] for f in (100, 200, 300, 400)}
    assert len(forward.batches) < 4  # shared
    assert max(len(batch) for batch in forward.batches) <= 8
    # In arrival order: each request's inputs together, in its order.
    firsts = [item.ids[0] for batch in forward.batches for item in batch]
    blocks = [firsts[at : at + 3] for at in range(0, 12, 3)]
    assert all(block == [block[0], block[0] + 1, block[0] + 2] for block in blocks)


@pytest.mark.slow
async def test_a_pass_holds_at_most_its_tokens_and_its_time(
    thread: MLXThread,
) -> None:
    forward = Passes()
    unpaced = PassQueue(thread, forward, batch_tokens=40, batch_size=64)
    await unpaced.run(inputs(0, 30))
    assert max(len(b) * 4 for b in forward.batches) <= 40
    forward.batches.clear()
    # About 0.02 s a pass: at most 0.02 / PER_TOKEN = 100 padded tokens once
    # the first pass measured the cost (the sleep is never shorter).
    paced = PassQueue(thread, forward, batch_size=64, seconds=0.02)
    await paced.run(inputs(0, 200))
    sizes = [len(batch) * 4 for batch in forward.batches[1:]]
    assert max(sizes) <= 100
    assert len(forward.batches) >= 200 * 4 // 100


@pytest.mark.slow
async def test_a_long_input_is_one_pass_alone(thread: MLXThread) -> None:
    forward = Passes()
    queue = PassQueue(thread, forward, batch_tokens=16)
    rows = await queue.run([Encoded([1] * 40), Encoded([2])])
    assert [float(row[0]) for row in rows] == [1, 2]
    assert [len(batch) for batch in forward.batches] == [1, 1]


@pytest.mark.slow
async def test_a_cancelled_request_leaves_the_queue(thread: MLXThread) -> None:
    forward = Passes()
    queue = PassQueue(thread, forward, batch_size=4)
    with anyio.move_on_after(0.02):
        await queue.run(inputs(0, 400))
    assert queue.waiting == 0
    assert len(await queue.run(inputs(1000, 2))) == 2


@pytest.mark.slow
async def test_a_failed_pass_fails_its_requests_only(thread: MLXThread) -> None:
    forward = Passes(fail_on=7)
    queue = PassQueue(thread, forward, batch_size=2)
    failed: list[BaseException] = []
    rows: list[np.ndarray] = []

    async def broken() -> None:
        try:
            await queue.run(inputs(6, 4))  # 6, 7, 8, 9: the pass of 6 and 7 fails
        except RuntimeError as exc:
            failed.append(exc)

    async def fine() -> None:
        rows.extend(await queue.run(inputs(50, 2)))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(broken)
        await anyio.lowlevel.checkpoint()
        tasks.start_soon(fine)
    assert [str(exc) for exc in failed] == ["the pass broke"]
    assert [float(row[0]) for row in rows] == [50, 51]
    assert queue.waiting == 0
