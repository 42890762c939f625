"""Dispatch cost of a trivial job from an asyncio loop, side by side.

Compares ``await MLXThread.run(noop)`` with ``loop.run_in_executor`` on a
one-worker ``ThreadPoolExecutor``, ``asyncio.to_thread``,
``anyio.to_thread.run_sync`` with a limiter of 1, and a bare thread with a
``SimpleQueue`` and one ``call_soon_threadsafe`` per completion (the floor).
Each round runs every case once, interleaved; ratios are per round and the
table shows their median over the rounds.

    python benchmarks/dispatch.py [--rounds 5] [--calls 3000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from queue import SimpleQueue
from typing import Any

import anyio
import anyio.to_thread

from mlx_pinned import MLXThread


def noop() -> None:
    return None


class BareThread:
    """The floor: one thread, a SimpleQueue, a call_soon_threadsafe per job."""

    def __init__(self) -> None:
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, loop, future = item
            result = fn()
            loop.call_soon_threadsafe(_set_result, future, result)

    async def run(self, fn: Callable[[], object]) -> object:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, loop, future))
        return await future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def _set_result(future: asyncio.Future[object], result: object) -> None:
    if not future.done():
        future.set_result(result)


Case = Callable[[], Awaitable[object]]


def make_cases(
    thread: MLXThread, pool: ThreadPoolExecutor, bare: BareThread
) -> dict[str, Case]:
    limiter = anyio.CapacityLimiter(1)

    async def pinned() -> object:
        return await thread.run(noop)

    async def executor() -> object:
        return await asyncio.get_running_loop().run_in_executor(pool, noop)

    async def to_thread() -> object:
        return await asyncio.to_thread(noop)

    async def anyio_thread() -> object:
        return await anyio.to_thread.run_sync(noop, limiter=limiter)

    async def floor() -> object:
        return await bare.run(noop)

    return {
        "mlx_pinned MLXThread.run": pinned,
        "run_in_executor(ThreadPoolExecutor(1))": executor,
        "asyncio.to_thread": to_thread,
        "anyio.to_thread.run_sync (limiter 1)": anyio_thread,
        "bare thread + SimpleQueue (floor)": floor,
    }


async def sequential(case: Case, calls: int) -> list[float]:
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        await case()
        latencies.append(time.perf_counter() - start)
    return latencies


async def concurrent(case: Case, calls: int, concurrency: int) -> float:
    per_task = max(1, calls // concurrency)

    async def submitter() -> None:
        for _ in range(per_task):
            await case()

    start = time.perf_counter()
    await asyncio.gather(*(submitter() for _ in range(concurrency)))
    return per_task * concurrency / (time.perf_counter() - start)


def consume_items(count: int) -> Iterator[int]:
    yield from range(count)


async def items_per_second(thread: MLXThread, count: int) -> tuple[float, float]:
    start = time.perf_counter()
    async for _ in thread.iterate(consume_items, count):
        pass
    pinned = count / (time.perf_counter() - start)
    # The usual alternative: anyio/Starlette's iterate_in_threadpool, one
    # to_thread call per item (with a limiter of 1 so one thread runs it).
    limiter = anyio.CapacityLimiter(1)
    sentinel = object()
    gen = consume_items(count)
    start = time.perf_counter()
    while (
        await anyio.to_thread.run_sync(next, gen, sentinel, limiter=limiter)
        is not sentinel
    ):
        pass
    pooled = count / (time.perf_counter() - start)
    return pinned, pooled


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(rounds: int, calls: int, concurrency: int) -> None:
    pool = ThreadPoolExecutor(1)
    bare = BareThread()
    async with MLXThread(name="bench") as thread:
        cases = make_cases(thread, pool, bare)
        for case in cases.values():  # warm up every path once
            await sequential(case, 200)
            await concurrent(case, 500, concurrency)
        rows: dict[str, dict[str, list[float]]] = {
            name: {"p50": [], "p99": [], "tput": []} for name in cases
        }
        items: list[tuple[float, float]] = []
        for _ in range(rounds):
            for name, case in cases.items():
                latencies = await sequential(case, calls)
                rows[name]["p50"].append(percentile(latencies, 0.5))
                rows[name]["p99"].append(percentile(latencies, 0.99))
                rows[name]["tput"].append(await concurrent(case, calls, concurrency))
            items.append(await items_per_second(thread, calls))
    pool.shutdown()
    bare.close()

    base, floor = (
        "run_in_executor(ThreadPoolExecutor(1))",
        "bare thread + SimpleQueue (floor)",
    )
    pinned = "mlx_pinned MLXThread.run"

    def ratio(name: str, metric: str, against: str) -> float:
        return statistics.median(
            a / b
            for a, b in zip(rows[name][metric], rows[against][metric], strict=True)
        )

    print(
        f"{rounds} rounds, {calls} calls per case per round, {concurrency} submitters"
    )
    print()
    print("| case | p50 µs | p99 µs | calls/s (c64) | tput ÷ TPE(1) | p50 ÷ TPE(1) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(
            f"| {name} | {statistics.median(row['p50']) * 1e6:.0f}"
            f" | {statistics.median(row['p99']) * 1e6:.0f}"
            f" | {statistics.median(row['tput']):,.0f}"
            f" | {ratio(name, 'tput', base):.2f}× | {ratio(name, 'p50', base):.2f}× |"
        )
    print()
    print(
        f"MLXThread throughput ÷ floor (median of per-round ratios): "
        f"{ratio(pinned, 'tput', floor):.2f}×"
    )
    print(
        f"MLXThread p50 ÷ ThreadPoolExecutor(1) p50: {ratio(pinned, 'p50', base):.2f}×"
    )
    pinned_items = statistics.median(a for a, _ in items)
    pooled_items = statistics.median(b for _, b in items)
    print(
        f"iterate: {pinned_items:,.0f} items/s vs per-item anyio.to_thread"
        f" {pooled_items:,.0f} items/s"
        f" ({statistics.median(a / b for a, b in items):.2f}×)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    options = parser.parse_args()
    asyncio.run(main(options.rounds, options.calls, options.concurrency))
