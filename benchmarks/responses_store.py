"""The Responses store's put and get, awaited from an asyncio loop: in
memory, and in SQLite under a state dir (a temporary folder, or ``--dir``).

For each backing: the wall time of an awaited ``put`` and ``get`` (median
and p99 over ``--ops``), and the loop thread's own CPU time per call (what
the event loop spends on it; the rest runs on the store's worker thread),
for a turn of about ``--turn-bytes`` bytes, one call at a time and
``--concurrency`` at once.

    python benchmarks/responses_store.py [--ops 500] [--turn-bytes 4000]
                                         [--concurrency 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mlx_pinned.server.http.responses_api.sqlite_store import SQLiteStore
from mlx_pinned.server.http.responses_api.store import MemoryStore, ResponseStore


def turn(index: int, size: int) -> tuple[Any, ...]:
    """A stored turn of about ``size`` bytes: half answer, half conversation."""
    text = "x" * (size // 2)
    response = {"id": f"resp_{index}", "output": [{"type": "message", "text": text}]}
    messages = ({"role": "user", "content": text},)
    return response, [{"id": f"msg_{index}"}], messages, ()


async def timed(
    calls: list[Callable[[], Awaitable[Any]]], concurrency: int
) -> tuple[list[float], float]:
    """Each call's wall time (ms), and the loop thread's CPU time per call
    (us), ``concurrency`` calls in flight at a time."""
    walls: list[float] = []
    pending = iter(calls)

    async def worker() -> None:
        for call in pending:
            start = time.perf_counter()
            await call()
            walls.append((time.perf_counter() - start) * 1e3)

    cpu = time.thread_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return walls, (time.thread_time() - cpu) / len(calls) * 1e6


def row(name: str, walls: list[float], loop_us: float) -> str:
    walls = sorted(walls)
    p99 = walls[min(len(walls) - 1, int(len(walls) * 0.99))]
    median = statistics.median(walls)
    return f"| {name} | {median:.3f} | {p99:.3f} | {loop_us:.0f} |"


async def measure(
    name: str, store: ResponseStore, args: argparse.Namespace
) -> list[str]:
    rows = []
    for concurrency in (1, args.concurrency):
        base = concurrency * args.ops
        puts = [
            functools.partial(store.put, *turn(base + index, args.turn_bytes))
            for index in range(args.ops)
        ]
        walls, loop_us = await timed(puts, concurrency)
        rows.append(row(f"{name} put, c{concurrency}", walls, loop_us))
        gets = [
            functools.partial(store.get, f"resp_{base + index}")
            for index in range(args.ops)
        ]
        walls, loop_us = await timed(gets, concurrency)
        rows.append(row(f"{name} get, c{concurrency}", walls, loop_us))
    await store.aclose()
    return rows


async def main(args: argparse.Namespace) -> None:
    bound = (10 * args.ops * (args.concurrency + 1), 10**10)
    rows = await measure("memory", MemoryStore(*bound), args)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.dir or scratch)
        rows += await measure("sqlite", SQLiteStore.open(folder, *bound), args)
    print(f"turns of about {args.turn_bytes} bytes, {args.ops} calls each\n")
    print("| store, call | median ms | p99 ms | loop CPU us per call |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--turn-bytes", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dir", help="the state dir (default: a temporary one)")
    asyncio.run(main(parser.parse_args()))
