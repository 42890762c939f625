"""Long prompts that hold no one hostage: three figures of issue 44, in
process, on the tiny model with the server's defaults.

- ``short``: a short question sent ``--after`` seconds into a long prompt's
  prefill: its time to first token, and the long prompt's against alone.
- ``shared``: two identical long prompts sent together: the time until both
  answered against one alone, and the second's cached share of its prompt.
- ``abandoned``: a long prompt whose client leaves 70 % of the way into its
  prefill, sent again at once: the retry's time to first token against a
  cold prefill, and its cached share.

Each round uses a prompt of its own (nothing cached from the round before).
Times are medians of ``--rounds``. Expensive: a quiet machine, never CI.

::

    python benchmarks/long_prompts.py [--scenarios short,shared,abandoned]
        [--prompt-tokens 10000] [--rounds 3] [--after 1.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio


def long_params(tokens: int, round_index: int, tag: str) -> Any:
    from mlx_pinned.server.events import GenerationParams, SamplingParams

    # 24 tokens a sentence with the tiny model's tokenizer.
    words = "the quick brown fox jumps over the lazy dog " * max(1, tokens // 24)
    text = f"({tag} {round_index}) {words}"
    return GenerationParams(
        ({"role": "user", "content": text},),
        max_tokens=2,
        sampling=SamplingParams(temperature=0.0),
    )


def short_params(round_index: int) -> Any:
    from mlx_pinned.server.events import GenerationParams, SamplingParams

    return GenerationParams(
        ({"role": "user", "content": f"({round_index}) What is two and two?"},),
        max_tokens=2,
        sampling=SamplingParams(temperature=0.0),
    )


async def first_token(engine: Any, params: Any) -> tuple[float, Any]:
    """Seconds to the first event, and the final event."""
    start = time.perf_counter()
    ttft = None
    last = None
    async with engine.stream(params, []) as stream:
        async for event in stream:
            ttft = time.perf_counter() - start if ttft is None else ttft
            last = event
    assert ttft is not None
    return ttft, last


async def short(engine: Any, args: argparse.Namespace, r: int) -> dict[str, float]:
    alone, _ = await first_token(engine, long_params(args.prompt_tokens, r, "alone"))
    beside: dict[str, float] = {}

    async def run_long() -> None:
        params = long_params(args.prompt_tokens, r, "beside")
        beside["long"], _ = await first_token(engine, params)

    async def run_short() -> None:
        await anyio.sleep(args.after)
        beside["short"], _ = await first_token(engine, short_params(r))

    async with anyio.create_task_group() as group:
        group.start_soon(run_long)
        group.start_soon(run_short)
    return {
        "short TTFT (s)": beside["short"],
        "long TTFT (s)": beside["long"],
        "long TTFT / alone": beside["long"] / alone,
    }


async def shared(engine: Any, args: argparse.Namespace, r: int) -> dict[str, float]:
    start = time.perf_counter()
    await first_token(engine, long_params(args.prompt_tokens, r, "one"))
    one = time.perf_counter() - start
    params = long_params(args.prompt_tokens, r, "two")
    finals: list[Any] = []

    async def run() -> None:
        finals.append((await first_token(engine, params))[1])

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(run)
        group.start_soon(run)
    both = time.perf_counter() - start
    second = max(finals, key=lambda event: event.cached_tokens)
    return {
        "two / one alone": both / one,
        "second's cached share": second.cached_tokens / second.prompt_tokens,
    }


async def abandoned(engine: Any, args: argparse.Namespace, r: int) -> dict[str, float]:
    cold, _ = await first_token(engine, long_params(args.prompt_tokens, r, "cold"))
    params = long_params(args.prompt_tokens, r, "left")
    with anyio.move_on_after(0.7 * cold):
        await first_token(engine, params)
    retry, last = await first_token(engine, params)
    return {
        "retry / cold": retry / cold,
        "retry's cached share": last.cached_tokens / last.prompt_tokens,
    }


SCENARIOS = {"short": short, "shared": shared, "abandoned": abandoned}


async def main_async(args: argparse.Namespace) -> None:
    from mlx_pinned import MLXThread
    from mlx_pinned.server.config import ModelSettings
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.testing import tiny_vlm_path

    settings = ModelSettings.of(tiny_vlm_path(), prompt_cache_bytes=2**30)
    async with MLXThread(name="long-prompts") as thread:
        engine = await thread.run(BatchEngine.load, settings, thread)
        await first_token(engine, long_params(500, -1, "warm-up"))
        for name in args.scenarios:
            rounds = [
                await SCENARIOS[name](engine, args, r) for r in range(args.rounds)
            ]
            print(f"{name} ({args.prompt_tokens} tokens, {args.rounds} rounds):")
            for figure in rounds[0]:
                values = [round_[figure] for round_ in rounds]
                shown = ", ".join(f"{v:.2f}" for v in values)
                print(f"  {figure:<24} {statistics.median(values):7.2f}   ({shown})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios",
        type=lambda text: [part for part in text.split(",") if part],
        default=list(SCENARIOS),
    )
    parser.add_argument("--prompt-tokens", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--after", type=float, default=1.5)
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
