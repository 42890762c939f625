"""Decode-bound throughput against the ceiling of a bare loop, in one run.

On the tiny text model, ``--rows`` identical greedy requests of ``--tokens``
tokens each, three ways, alternating round by round (ABCABC...):

- ``bare``: the ceiling. One process, the model's language model over a
  batch of the prompt ``--rows`` times: batched forward and argmax,
  pipelined with ``mx.async_eval`` (the next step is built before this one
  is read), each step's tokens read as Python ints, nothing else.
- ``engine``: the server's engine in process (``BatchEngine.stream``, one
  stream per request read on the event loop), no HTTP.
- ``server``: ``mlx-pinned serve`` in its own process, the requests
  streamed over HTTP (``stream: true``) by an httpx client in this one;
  ``--compare ARGS`` adds servers with other options to the same rounds.

Each way's tokens/s counts the tokens every request received over the wall
time from the first request sent to the last token read (prompts are short:
prefill is a few ms of it). The table gives each way's median over the
rounds and its ratio to ``bare``'s median of the same run. Expensive: a
quiet machine, never CI.

::

    python benchmarks/decode_ceiling.py [--rows 32] [--tokens 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import free_port, server, sse_json, wait_for

PROMPT = "Count to a thousand."


def bare(loaded: Any, rows: int, tokens: int) -> tuple[int, float]:
    """The bare loop: (tokens made, seconds)."""
    import mlx.core as mx

    from mlx_pinned.server.engine.sampling import vlm

    lm = loaded.model.language_model
    tokenizer = loaded.tokenizer
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    ids = list(getattr(ids, "input_ids", ids))
    start = time.perf_counter()
    cache = vlm().make_prompt_cache(lm)
    prompt = mx.array([ids] * rows, dtype=mx.uint32)
    logits = lm(prompt, cache=cache).logits[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.async_eval(y)
    made = 0
    for _ in range(tokens):
        nxt = mx.argmax(lm(y[:, None], cache=cache).logits[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        made += len(y.tolist())
        y = nxt
    return made, time.perf_counter() - start


async def engine_round(engine: Any, rows: int, tokens: int) -> tuple[int, float]:
    from mlx_pinned.server.events import FinalEvent, GenerationParams

    params = GenerationParams(
        ({"role": "user", "content": PROMPT},), max_tokens=tokens, temperature=0.0
    )
    counts: list[int] = []

    async def one() -> None:
        async with engine.stream(params, []) as stream:
            counts.extend(
                [e.completion_tokens async for e in stream if isinstance(e, FinalEvent)]
            )

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(rows)))
    return sum(counts), time.perf_counter() - start


async def server_round(client: Any, rows: int, tokens: int) -> tuple[int, float]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    counts: list[int] = []

    async def one() -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            counts.extend(
                [
                    e["usage"]["completion_tokens"]
                    async for e in sse_json(r)
                    if e.get("usage")
                ]
            )

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(rows)))
    return sum(counts), time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> None:
    import httpx

    from mlx_pinned import MLXThread
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.server.engine.model import load
    from mlx_pinned.testing import tiny_lm_path

    model = Path(args.model) if args.model else tiny_lm_path()
    command = [
        sys.executable,
        *("-m", "mlx_pinned.server", "serve", str(model)),
        *("--served-model-name", "tiny", "--log-level", "warning"),
        *("--max-num-seqs", str(args.rows), "--max-pending", "1024"),
    ]
    servers = {"server": [*command, *args.server_args.split()]}
    for i, extra in enumerate(args.compare):
        servers[f"server{i + 2}"] = [*command, *extra.split()]
    ways = ["bare", "engine", *servers]
    results: dict[str, list[float]] = {way: [] for way in ways}
    made: dict[str, list[int]] = {way: [] for way in ways}
    folder = Path(tempfile.mkdtemp())
    limits = httpx.Limits(max_connections=args.rows + 4)
    async with contextlib.AsyncExitStack() as stack:
        thread = await stack.enter_async_context(MLXThread(name="ceiling"))
        loaded = await thread.run(load, model)
        engine = BatchEngine(loaded, thread)
        clients: dict[str, Any] = {}
        for way, argv in servers.items():
            port = free_port()
            argv = [*argv, "--port", str(port)]
            process = stack.enter_context(server(argv, folder / f"{way}.log"))
            client = await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
                )
            )
            await wait_for(client, process, "/health", 120)
            clients[way] = client
            print(f"{way}: {' '.join(argv[1:])}", flush=True)
        # Warm-up: kernels compiled, caches made, once each way.
        await thread.run(bare, loaded, args.rows, 8)
        await engine_round(engine, args.rows, 8)
        for client in clients.values():
            await server_round(client, args.rows, 8)
        for r in range(args.rounds):
            for way in ways:
                if way == "bare":
                    n, seconds = await thread.run(bare, loaded, args.rows, args.tokens)
                elif way == "engine":
                    n, seconds = await engine_round(engine, args.rows, args.tokens)
                else:
                    n, seconds = await server_round(
                        clients[way], args.rows, args.tokens
                    )
                results[way].append(n / seconds)
                made[way].append(n)
            print(
                f"round {r + 1}: "
                + "  ".join(f"{w} {v[-1]:,.0f}" for w, v in results.items()),
                flush=True,
            )
    ceiling = statistics.median(results["bare"])
    print(f"\n{args.rows} rows x {args.tokens} tokens, {args.rounds} rounds")
    print(f"{'way':>8} {'tokens/s (median)':>18} {'x bare':>7} {'tokens':>7}")
    for way, values in results.items():
        median = statistics.median(values)
        print(
            f"{way:>8} {median:>18,.0f} {median / ceiling:>7.2f} "
            f"{statistics.median(made[way]):>7.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", help="model folder (default: the tiny qwen3)")
    parser.add_argument(
        "--server-args", default="", help="more options of the server's command"
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="ARGS",
        help="another server, with these options (as one string), in the same "
        "rounds: server2, server3, ...",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.rows < 1 or args.tokens < 1:
        parser.error("--rows, --tokens and --rounds must be 1 or more")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
