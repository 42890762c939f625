"""A running stream's longest pause while a long prompt arrives.

In process, on the tiny model: a stream generates ``--tokens`` tokens; once
it has some, a prompt of about ``--prompt-tokens`` tokens arrives. The
stream's tokens are timed as its consumer receives them; the longest gap
between two of them, and the long prompt's time to first token, are printed
for each ``--prefill-step-size`` given (the largest, one chunk for the whole
prompt, is how the engine prefilled a long prompt before chunked prefill).
Expensive: a quiet machine, never CI.

::

    python benchmarks/prefill_gap.py [--steps 16384,2048,512] [--prompt-tokens 8000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import anyio
from _common import positive_ints


async def one(
    steps: int, args: argparse.Namespace, loaded: object, thread: object
) -> tuple[float, float]:
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.server.events import GenerationParams

    engine = BatchEngine(loaded, thread, prefill_step_size=steps)  # type: ignore[arg-type]
    running = GenerationParams(
        ({"role": "user", "content": "Count to a thousand."},),
        max_tokens=args.tokens,
        temperature=0.0,
    )
    words = "the quick brown fox jumps over the lazy dog " * (args.prompt_tokens // 9)
    long = GenerationParams(
        ({"role": "user", "content": words},), max_tokens=2, temperature=0.0
    )
    times: list[float] = []
    arrived = anyio.Event()
    first_token: list[float] = []

    async def run_stream() -> None:
        async with engine.stream(running, []) as stream:
            async for _ in stream:
                times.append(time.perf_counter())
                if len(times) == 20:
                    arrived.set()

    async def run_long() -> None:
        await arrived.wait()
        start = time.perf_counter()
        async with engine.stream(long, []) as stream:
            async for _ in stream:
                first_token.append(time.perf_counter() - start)
                break

    async with anyio.create_task_group() as group:
        group.start_soon(run_stream)
        group.start_soon(run_long)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return max(gaps), first_token[0]


async def main_async(args: argparse.Namespace) -> None:
    from mlx_pinned import MLXThread
    from mlx_pinned.server.engine.model import load
    from mlx_pinned.testing import tiny_vlm_path

    async with MLXThread(name="prefill-gap") as thread:
        loaded = await thread.run(load, tiny_vlm_path())
        await one(max(args.steps), args, loaded, thread)  # warm-up
        print(f"{'prefill step':>13} {'longest gap (ms)':>17} {'long TTFT (ms)':>15}")
        for steps in args.steps:
            results = [
                await one(steps, args, loaded, thread) for _ in range(args.rounds)
            ]
            gap = statistics.median(r[0] for r in results)
            ttft = statistics.median(r[1] for r in results)
            print(f"{steps:>13} {gap * 1e3:>17.1f} {ttft * 1e3:>15.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_ints, default=[16384, 2048, 512])
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
