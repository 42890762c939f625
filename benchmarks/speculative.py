"""Speculative decoding against none, in one run: prompt lookup, a draft
model, or a native drafter (MTP layers, Gemma 4's assistant, DFlash,
EAGLE-3).

In process: the same greedy (or, with ``--temperature``, seeded) requests
through two engines of one loaded model, speculation off (A) and on (B),
alternated ABAB (the order flips every round), at one stream and at each
of ``--concurrency`` streams. Prints each
round's tokens/s and the median of the on/off ratios, and, with
speculation on, the drafts' acceptance rate and tokens per step. Greedy and
seeded output is the same token for token (tests/server/test_speculative.py,
tests/server/test_draft_model.py), so both engines generate the same
tokens. Measure on a quiet machine; ``--quick`` is a smoke run (under a
minute).

- Prompt lookup (the default): on the tiny demo model, whose random weights
  repeat themselves, so prompt lookup finds drafts; ``--size bench`` on the
  bench model (``--size tiny,bench``: both, then side by side), whose
  32,768-token vocabulary repeats itself less.
- ``--draft-model PATH --model PATH``: a draft model for a served model
  (on a Mac: real ones).
- ``--synthetic-draft DAMPING``: a random served model (``--size``'s) and a
  one-layer draft that agrees with it on most tokens, written offline by
  ``_draft_pair.py`` (``DAMPING`` sets how often: 0.1 is about 0.75 at the
  tiny size).
- ``--mtp DAMPING``: the Qwen3.5 of ``--size`` (or ``--model``, a Qwen3.5
  folder) written with MTP layers that agree with it (``mlx_pinned.testing``'s
  ``make_tiny_mtp``: 0.05 keeps every draft), drafting with them.
- ``--assistant DAMPING``: the Gemma 4 of ``--size`` and an assistant that
  agrees with it (``make_tiny_assistant``).
- ``--dflash DAMPING``: the Qwen3.5 of ``--size`` and a DFlash drafter that
  agrees with it (``make_tiny_dflash``: 0.05 keeps every draft, 0.4 most).
- ``--eagle3 DAMPING``: the Qwen3.5 of ``--size`` with its layers twice and
  an EAGLE-3 drafter that agrees with it (``make_tiny_eagle3``).

The machine's load average is printed at the start and the end of each
size, and each ratio also per second of the process's CPU time: other work
on the cores moves every wall-clock figure.

::

    python benchmarks/speculative.py [--quick] [--rounds 5] [--tokens 256]
        [--concurrency 8,32] [--temperature T] [--ngram 3] [--draft-tokens 4]
        [--max-batch N] [--size tiny|bench|tiny,bench]
        [--draft-model PATH --model PATH | --synthetic-draft DAMPING
         | --mtp DAMPING [--model PATH] | --assistant DAMPING
         | --dflash DAMPING | --eagle3 DAMPING]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from _common import model_path, size_option
from _draft_pair import write_pair


def requests(count: int, tokens: int, temperature: float) -> list[Any]:
    from mlx_pinned.server.events import GenerationParams, SamplingParams

    prompts = [f"Tell story number {i}, then tell it again." for i in range(count)]
    return [
        GenerationParams(
            ({"role": "user", "content": prompt},),
            max_tokens=tokens,
            sampling=SamplingParams(temperature=temperature, seed=i),
        )
        for i, prompt in enumerate(prompts)
    ]


async def rate(
    engine: Any, count: int, tokens: int, temperature: float = 0.0
) -> tuple[float, float]:
    """Generated tokens per second of ``count`` streams at once, and per
    second of the process's CPU time (less moved by other work on the
    cores)."""
    made = 0

    async def one(params: Any) -> None:
        nonlocal made
        async with engine.stream(params, []) as stream:
            async for event in stream:
                if getattr(event, "completion_tokens", None) is not None:
                    made += event.completion_tokens

    start, cpu = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as group:
        for params in requests(count, tokens, temperature):
            group.start_soon(one, params)
    return made / (time.perf_counter() - start), made / (time.process_time() - cpu)


async def main_async(args: argparse.Namespace, size: str) -> dict[int, str]:
    """The rounds on the ``size`` model (``"model"``: ``--model``); each
    stream count's summary."""
    from mlx_pinned import MLXThread
    from mlx_pinned.server.engine import BatchEngine, DraftSettings
    from mlx_pinned.server.engine.model import load
    from mlx_pinned.testing import (
        make_tiny_assistant,
        make_tiny_dflash,
        make_tiny_eagle3,
        make_tiny_mtp,
    )

    model = args.model or model_path(size)
    draft = args.draft_model
    settings = DraftSettings(args.ngram, args.draft_tokens, max_batch=args.max_batch)
    if args.synthetic_draft is not None:
        folder = Path(tempfile.mkdtemp(prefix="draft-pair-"))
        model, draft = write_pair(folder, size=size, damping=args.synthetic_draft)
    if args.assistant is not None:
        folder = Path(tempfile.mkdtemp(prefix="assistant-"))
        source = model_path(size, "gemma4")
        model, draft = make_tiny_assistant(folder, source, damping=args.assistant)
    if args.dflash is not None:
        folder = Path(tempfile.mkdtemp(prefix="dflash-"))
        source = model_path(size, "qwen3_5")
        model, draft = make_tiny_dflash(folder, source, damping=args.dflash)
    if args.eagle3 is not None:
        folder = Path(tempfile.mkdtemp(prefix="eagle3-"))
        source = model_path(size, "qwen3_5")
        model, draft = make_tiny_eagle3(folder, source, damping=args.eagle3)
    if draft is not None:
        settings = DraftSettings(
            tokens=args.draft_tokens, model=draft, max_batch=args.max_batch
        )
    if args.mtp is not None:
        source = args.model or model_path(size, "qwen3_5")
        folder = Path(tempfile.mkdtemp(prefix="mtp-"))
        model = make_tiny_mtp(folder / "model", source, damping=args.mtp)
        settings = DraftSettings(
            tokens=args.draft_tokens, mtp=True, max_batch=args.max_batch
        )
    summaries: dict[int, str] = {}
    print(f"served {model}; drafts: {settings}", flush=True)
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    async with MLXThread(name="speculative") as thread:
        loaded = await thread.run(load, model)

        def make() -> tuple[Any, Any]:
            on = BatchEngine(loaded, thread)
            on.speculate(settings)
            return BatchEngine(loaded, thread), on

        off, on = await thread.run(make)
        for engine in (off, on):  # warm-up: kernels, both shapes
            await rate(engine, 2, 16)
        columns = ("streams", 7), ("round", 5), ("off tok/s", 10), ("on tok/s", 10)
        print(
            *(f"{name:>{width}}" for name, width in columns),
            f"{'ratio':>6} {'per CPU s':>9}",
        )
        for streams in (1, *args.concurrency):
            ratios, by_cpu = [], []
            before = on.statistics()
            for round_ in range(args.rounds):
                pair = (off, on) if round_ % 2 == 0 else (on, off)
                got = {
                    id(e): await rate(e, streams, args.tokens, args.temperature)
                    for e in pair
                }
                (a, a_cpu), (b, b_cpu) = got[id(off)], got[id(on)]
                ratios.append(b / a)
                by_cpu.append(b_cpu / a_cpu)
                print(
                    f"{streams:>7} {round_:>5} {a:>10.0f} {b:>10.0f} {b / a:>6.2f} "
                    f"{b_cpu / a_cpu:>9.2f}"
                )
            after = on.statistics()
            drafted = after.draft_tokens - before.draft_tokens
            kept = after.accepted_tokens - before.accepted_tokens
            rows = after.speculative_rows - before.speculative_rows
            steps = after.steps - before.steps
            share = (after.speculative_steps - before.speculative_steps) / max(steps, 1)
            summaries[streams] = (
                f"median on/off {statistics.median(ratios):.2f}x "
                f"({statistics.median(by_cpu):.2f}x per CPU second); "
                f"acceptance {kept / max(drafted, 1):.2f}, "
                f"{(rows + kept) / max(rows, 1):.2f} tokens per row and "
                f"speculative step, {share:.0%} of the steps speculative"
            )
            print(f"c{streams}: {summaries[streams]}")
        print(f"load average at the end: {os.getloadavg()}", flush=True)
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[8, 32],
        help="the batched stream counts measured after one (default: 8,32)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample (seeded per request) instead of greedy: on the random "
        "weights, text that prompt lookup drafts badly (default: 0, greedy)",
    )
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument(
        "--max-batch",
        type=int,
        default=0,
        help="speculate only while the batch holds at most N rows, as the "
        "server's --draft-max-batch (default 0: at any size)",
    )
    parser.add_argument("--model", type=Path, help="the served model's folder")
    size_option(parser)
    parser.add_argument(
        "--draft-model", type=Path, help="a draft model instead of prompt lookup"
    )
    parser.add_argument(
        "--synthetic-draft",
        type=float,
        metavar="DAMPING",
        help="a random served model and a one-layer draft that agrees with it",
    )
    parser.add_argument(
        "--mtp",
        type=float,
        metavar="DAMPING",
        help="the tiny Qwen3.5 (or --model) with MTP layers that agree with it",
    )
    parser.add_argument(
        "--assistant",
        type=float,
        metavar="DAMPING",
        help="the tiny Gemma 4 and an assistant that agrees with it",
    )
    parser.add_argument(
        "--dflash",
        type=float,
        metavar="DAMPING",
        help="the tiny Qwen3.5 and a DFlash drafter that agrees with it",
    )
    parser.add_argument(
        "--eagle3",
        type=float,
        metavar="DAMPING",
        help="the tiny Qwen3.5 and an EAGLE-3 drafter that agrees with it",
    )
    args = parser.parse_args(argv)
    writers = [
        args.synthetic_draft,
        args.mtp,
        args.assistant,
        args.dflash,
        args.eagle3,
    ]
    if sum(w is not None for w in writers) > 1:
        parser.error("--synthetic-draft, --mtp, --assistant, --dflash, --eagle3: one")
    if args.synthetic_draft is not None and (args.model or args.draft_model):
        parser.error("--synthetic-draft writes both models: no --model, --draft-model")
    if args.assistant is not None and (args.model or args.draft_model):
        parser.error("--assistant writes both models: no --model, --draft-model")
    for name in ("dflash", "eagle3"):
        if getattr(args, name) is not None and (args.model or args.draft_model):
            parser.error(f"--{name} writes both models: no --model, --draft-model")
    if args.mtp is not None and args.draft_model:
        parser.error("--mtp drafts with the model's own layers: no --draft-model")
    if args.quick:
        args.rounds, args.tokens = 2, 64
    summaries: dict[int, str] = {}
    for size in ["model"] if args.model else args.size:
        print(f"== {size}", flush=True)
        summaries[size] = anyio.run(main_async, args, size)
    if len(summaries) > 1:
        print("\nside by side:")
        for streams in summaries[args.size[0]]:
            for size, summary in summaries.items():
                print(f"c{streams} {size:<5} {summary[streams]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
