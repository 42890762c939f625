"""Predicted outputs against none, in one run: an edit, predicted.

In process, on the tiny text model: each request asks for ``--tokens``
greedy tokens. A warm-up run gives each request's own answer; its
prediction is that answer with a few characters changed every
``--edit-every`` characters (an edit: the model's answer is the text, with
a few words changed). Then the same requests run without a prediction (A)
and with one (B), alternated ABAB (the order flips every round), at one
stream and at ``--concurrency`` streams. Prints each way's tokens/s per
round, the median of the on/off ratios, and the share of predicted tokens
kept. Greedy output is the same with a prediction or without
(tests/server/test_speculative.py), so both ways make the same tokens.
Measure on a quiet machine; ``--quick`` is a smoke run.

::

    python benchmarks/predicted.py [--quick] [--rounds 5] [--tokens 300]
        [--concurrency 4] [--edit-every 60] [--max-batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio

PROMPT = "Rewrite the paragraph, number {i}, and keep its words."


def requests(count: int, tokens: int, predictions: list[str] | None) -> list[Any]:
    from mlx_pinned.server.events import GenerationParams, SamplingParams

    return [
        GenerationParams(
            ({"role": "user", "content": PROMPT.format(i=i)},),
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
            prediction="" if predictions is None else predictions[i],
        )
        for i in range(count)
    ]


def edit(text: str, every: int) -> str:
    """``text`` with two characters changed every ``every`` characters."""
    chars = list(text)
    for at in range(every // 2, len(chars) - 1, every):
        chars[at : at + 2] = "zq"
    return "".join(chars)


async def run(engine: Any, params: list[Any]) -> tuple[float, list[str], int, int]:
    """Tokens/s of ``params`` at once; each answer's text; the predicted
    tokens kept and not kept."""
    from mlx_pinned.server.events import FinalEvent

    texts = [""] * len(params)
    made = kept = refused = 0

    async def one(i: int) -> None:
        nonlocal made, kept, refused
        async with engine.stream(params[i], []) as stream:
            async for event in stream:
                texts[i] += event.text
                if isinstance(event, FinalEvent):
                    made += event.completion_tokens
                    kept += event.accepted_prediction_tokens
                    refused += event.rejected_prediction_tokens

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for i in range(len(params)):
            group.start_soon(one, i)
    return made / (time.perf_counter() - start), texts, kept, refused


async def main_async(args: argparse.Namespace) -> None:
    from mlx_pinned import MLXThread
    from mlx_pinned.server.engine import BatchEngine, DraftSettings
    from mlx_pinned.server.engine.model import load
    from mlx_pinned.testing import tiny_lm_path

    async with MLXThread(name="predicted-bench") as thread:
        loaded = await thread.run(load, tiny_lm_path())

        def make() -> Any:
            engine = BatchEngine(loaded, thread)
            engine.speculate(DraftSettings(tokens=8, max_batch=args.max_batch))
            return engine

        engine = await thread.run(make)
        print(f"tiny text model, {args.tokens} greedy tokens a request")
        for count in sorted({1, args.concurrency}):
            _, answers, _, _ = await run(engine, requests(count, args.tokens, None))
            guesses = [edit(text, args.edit_every) for text in answers]
            ratios, shares = [], []
            for round_ in range(args.rounds):
                order = [None, guesses] if round_ % 2 == 0 else [guesses, None]
                rates: dict[str, float] = {}
                for predictions in order:
                    asked = requests(count, args.tokens, predictions)
                    rate, texts, kept, refused = await run(engine, asked)
                    assert texts == answers, "a prediction changed an answer"
                    rates["on" if predictions else "off"] = rate
                    if predictions:
                        shares.append(kept / max(kept + refused, 1))
                ratios.append(rates["on"] / rates["off"])
                print(
                    f"c{count} round {round_ + 1}: off {rates['off']:7.0f} tok/s, "
                    f"on {rates['on']:7.0f} tok/s, on/off {ratios[-1]:.2f}"
                )
            print(
                f"c{count}: median on/off {statistics.median(ratios):.2f}, "
                f"predicted tokens kept {statistics.median(shares):.0%}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--edit-every", type=int, default=60)
    parser.add_argument(
        "--max-batch", type=int, default=4, help="the most rows that speculate (0: any)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = 2, 48
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
