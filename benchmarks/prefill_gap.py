"""A running stream's longest pause while a long prompt arrives.

In process, on the tiny model: a stream generates ``--tokens`` tokens; once
it has some, a prompt of about ``--prompt-tokens`` tokens arrives. The
stream's tokens are timed as its consumer receives them; the longest gap
between two of them, and the long prompt's time to first token, are printed
for each configuration given: ``TOKENS`` (``--prefill-step-size``, chunks of
that many tokens) or ``TOKENS:SECONDS`` (``--prefill-step-seconds`` too:
chunks sized by time while the stream decodes, at most ``TOKENS``). The
first configuration is the baseline the ratios are taken against (by default
16384: the whole prompt in one chunk, as the engine prefilled a long prompt
before chunked prefill): the longest gap over the baseline's time to first
token (the issue's goal: 0.25x at most), and the time to first token over
the baseline's (1.2x at most). Rounds alternate the configurations.
Expensive: a quiet machine, never CI.

::

    python benchmarks/prefill_gap.py [--configs 16384,2048,2048:0.25]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import anyio


def config(text: str) -> tuple[int, float | None]:
    """``TOKENS`` or ``TOKENS:SECONDS``."""
    tokens, _, seconds = text.partition(":")
    return int(tokens), float(seconds) if seconds else None


async def one(
    setting: tuple[int, float | None],
    args: argparse.Namespace,
    loaded: object,
    thread: object,
) -> tuple[float, float]:
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.server.events import GenerationParams, SamplingParams

    steps, seconds = setting
    engine = BatchEngine(
        loaded,  # type: ignore[arg-type]
        thread,  # type: ignore[arg-type]
        prefill_step_size=steps,
        prefill_step_seconds=seconds,
    )
    running = GenerationParams(
        ({"role": "user", "content": "Count to a thousand."},),
        max_tokens=args.tokens,
        sampling=SamplingParams(temperature=0.0),
    )
    words = "the quick brown fox jumps over the lazy dog " * (args.prompt_tokens // 9)
    long = GenerationParams(
        ({"role": "user", "content": words},),
        max_tokens=2,
        sampling=SamplingParams(temperature=0.0),
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
        await one(args.configs[0], args, loaded, thread)  # warm-up
        results: dict[tuple[int, float | None], list[tuple[float, float]]] = {
            c: [] for c in args.configs
        }
        for r in range(args.rounds):
            order = args.configs if r % 2 == 0 else args.configs[::-1]
            for setting in order:
                results[setting].append(await one(setting, args, loaded, thread))
            print(f"round {r + 1} done", flush=True)
        base = statistics.median(t for _, t in results[args.configs[0]])
        print(
            f"{'config':>12} {'longest gap (ms)':>17} {'long TTFT (ms)':>15} "
            f"{'gap/base TTFT':>14} {'TTFT/base':>10}"
        )
        for (steps, seconds), runs in results.items():
            gap = statistics.median(g for g, _ in runs)
            ttft = statistics.median(t for _, t in runs)
            name = f"{steps}" + (f":{seconds:g}" if seconds else "")
            print(
                f"{name:>12} {gap * 1e3:>17.1f} {ttft * 1e3:>15.1f} "
                f"{gap / base:>14.2f} {ttft / base:>10.2f}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        type=lambda text: [config(part) for part in text.split(",") if part],
        default=[(16384, None), (2048, None), (2048, 0.25)],
    )
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
