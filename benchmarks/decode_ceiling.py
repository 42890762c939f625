"""Decode-bound throughput against the ceiling of a bare loop, in one run.

On the tiny text model (``--size bench``: the bench one; ``--size
tiny,bench``: both, one after the other, then side by side), ``--rows``
identical greedy requests of ``--tokens`` tokens each, several ways,
alternating round by round (ABCABC...):

- ``strict``: the strict ceiling. One process, the model's language model
  over a batch of the prompt ``--rows`` times: batched forward and argmax,
  pipelined with ``mx.async_eval`` (the next step is built on this one's
  tokens before they are computed), nothing read until the end.
- ``bare``: the same loop reading each step's tokens as Python ints (the
  least a server must do); ``bare/kK`` (``--windows K,...``) reads them
  every K steps, K steps' tokens at once: what multi-step decode windows
  would save on host reads.
- ``engine``: the server's engine in process (``BatchEngine.stream``, one
  stream per request read on the event loop), no HTTP.
- ``server/CLIENT``: ``mlx-pinned serve`` in its own process, over HTTP,
  with each of ``--clients``: ``httpx`` streams (``stream: true``) and
  parses every event, as an SDK does; ``lean`` streams through aiohttp and
  reads the events' bytes as they come, parsing only the last (the usage),
  as a proxy does; ``whole`` asks for whole answers (``stream: false``)
  through aiohttp. ``--compare ARGS`` adds servers with other options to
  the same rounds (``server2/CLIENT``, ...); ``--compare-tree DIR`` adds
  the same server as ``server`` run from another checkout of mlx-pinned
  (its ``PYTHONPATH`` is ``DIR``, e.g. a ``git worktree`` of an older
  commit), named after the folder (``DIR_NAME/CLIENT``): a change measured
  against the code before it in the same rounds.

Each way's tokens/s counts the tokens every request received over the wall
time from the first request sent to the last token read (prompts are short:
prefill is a few ms of it). The table gives each way's median over the
rounds and its ratio to ``strict``'s median of the same run, and the CPU each
way used per token: this process's (the bare loop and the engine, or the
client), and the server process's (all its threads, from ``/proc``). On a
machine whose cores the model's compute already fills, the client's CPU
comes out of the server's: the ``lean`` and ``whole`` clients show the
server with less of it. Expensive: a quiet machine, never CI.

::

    python benchmarks/decode_ceiling.py [--rows 32] [--tokens 256] [--rounds 5]
        [--clients httpx,lean,whole] [--compare ARGS] [--compare-tree DIR]
        [--size tiny|bench|tiny,bench]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import free_port, model_path, server, size_option, sse_json, wait_for

PROMPT = "Count to a thousand."
TREE = Path(__file__).resolve().parents[1]  # the mlx-pinned this script is of
CLIENTS = ("httpx", "lean", "whole")


def bare(loaded: Any, rows: int, tokens: int, *, every: int = 1) -> int:
    """The bare loop: the tokens it made, read every ``every`` steps (0:
    none until the end)."""
    import mlx.core as mx

    from mlx_pinned.server.engine.sampling import vlm

    lm = loaded.model.language_model
    tokenizer = loaded.tokenizer
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    ids = list(getattr(ids, "input_ids", ids))
    cache = vlm().make_prompt_cache(lm)
    prompt = mx.array([ids] * rows, dtype=mx.uint32)
    logits = lm(prompt, cache=cache).logits[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.async_eval(y)

    def read(steps: list[Any]) -> int:
        """The steps' tokens as ints, in one read: how many."""
        if len(steps) == 1:
            return len(steps[0].tolist())
        return sum(map(len, mx.stack(steps).tolist()))

    made = 0
    steps: list[Any] = []
    for _ in range(tokens):
        nxt = mx.argmax(lm(y[:, None], cache=cache).logits[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        steps.append(y)
        if len(steps) == every:
            made += read(steps)
            steps = []
        y = nxt
    return made + (read(steps) if steps else 0)


async def engine_round(engine: Any, rows: int, tokens: int) -> int:
    from mlx_pinned.server.events import FinalEvent, GenerationParams, SamplingParams

    params = GenerationParams(
        ({"role": "user", "content": PROMPT},),
        max_tokens=tokens,
        sampling=SamplingParams(temperature=0.0),
    )
    counts: list[int] = []

    async def one() -> None:
        async with engine.stream(params, []) as stream:
            counts.extend(
                [e.completion_tokens async for e in stream if isinstance(e, FinalEvent)]
            )

    await asyncio.gather(*(one() for _ in range(rows)))
    return sum(counts)


def chat_body(tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def httpx_round(client: Any, rows: int, tokens: int) -> int:
    """Streamed, every event parsed (an SDK's way); the tokens received."""
    body = chat_body(tokens, stream=True)
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

    await asyncio.gather(*(one() for _ in range(rows)))
    return sum(counts)


async def lean_round(
    session: Any, url: str, rows: int, tokens: int, *, stream: bool
) -> int:
    """Through aiohttp: streamed, only the last event (the usage) parsed;
    or whole answers. The tokens received."""
    body = chat_body(tokens, stream=stream)
    counts: list[int] = []

    async def one() -> None:
        async with session.post(url, json=body) as r:
            r.raise_for_status()
            if not stream:
                counts.append((await r.json())["usage"]["completion_tokens"])
                return
            tail = b""
            async for data in r.content.iter_any():
                tail = (tail + data)[-4096:]
            counts.append(usage_of(tail))

    await asyncio.gather(*(one() for _ in range(rows)))
    return sum(counts)


def usage_of(tail: bytes) -> int:
    """The completion tokens of the last event with a usage in a stream's
    last bytes."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage":{' in line.replace(b" ", b""):
            return int(json.loads(line[6:])["usage"]["completion_tokens"])
    raise ValueError("no usage at the end of the stream")


def process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid``, all its threads (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main_async(args: argparse.Namespace, model: Path) -> dict[str, float]:
    """Every way's rounds on ``model``, and its table; each way's median
    tokens/s."""
    import aiohttp
    import httpx

    from mlx_pinned import MLXThread
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.server.engine.model import load

    command = [
        sys.executable,
        *("-m", "mlx_pinned.server", "serve", str(model)),
        *("--served-model-name", "tiny", "--log-level", "warning"),
        *("--max-num-seqs", str(args.rows), "--max-pending", "1024"),
    ]
    # Each server's command and the tree it runs from: ``-m`` puts the
    # working folder first on the path, so a server runs the code of the
    # folder it starts in (this script's tree, or a --compare-tree).
    servers = {"server": ([*command, *args.server_args.split()], TREE)}
    for i, extra in enumerate(args.compare):
        servers[f"server{i + 2}"] = ([*command, *extra.split()], TREE)
    for tree in args.compare_tree:
        name = tree.name
        while name in servers:
            name += "'"
        env = ["env", f"PYTHONPATH={tree}"]
        servers[name] = ([*env, *command, *args.server_args.split()], tree)
    folder = Path(tempfile.mkdtemp())
    limits = httpx.Limits(max_connections=args.rows + 4)
    # Each way: what runs a round (the tokens it got), and the server's pid.
    ways: dict[str, tuple[Callable[[int], Awaitable[int]], int | None]] = {}
    async with contextlib.AsyncExitStack() as stack:
        thread = await stack.enter_async_context(MLXThread(name="ceiling"))
        loaded = await thread.run(load, model)
        engine = BatchEngine(loaded, thread)
        for every in (0, 1, *args.windows):
            name = {0: "strict", 1: "bare"}.get(every, f"bare/k{every}")
            loop = functools.partial(bare, loaded, args.rows, every=every)
            ways[name] = (functools.partial(thread.run, loop), None)
        ways["engine"] = (functools.partial(engine_round, engine, args.rows), None)
        session = await stack.enter_async_context(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=args.rows + 4),
                timeout=aiohttp.ClientTimeout(total=600),
            )
        )
        for name, (argv, tree) in servers.items():
            port = free_port()
            argv = [*argv, "--port", str(port)]
            log = folder / f"{name}.log"
            process = stack.enter_context(server(argv, log, cwd=tree))
            base = f"http://127.0.0.1:{port}"
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=base, timeout=600, limits=limits)
            )
            await wait_for(client, process, "/health", 120)
            print(f"{name}: {' '.join(argv)}", flush=True)
            url = base + "/v1/chat/completions"
            rounds = {
                "httpx": functools.partial(httpx_round, client, args.rows),
                "lean": functools.partial(
                    lean_round, session, url, args.rows, stream=True
                ),
                "whole": functools.partial(
                    lean_round, session, url, args.rows, stream=False
                ),
            }
            for kind in args.clients:
                ways[f"{name}/{kind}"] = (rounds[kind], process.pid)
        results: dict[str, list[float]] = {way: [] for way in ways}
        made: dict[str, list[int]] = {way: [] for way in ways}
        cpu: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for run, _ in ways.values():  # warm-up: kernels compiled, caches made
            await run(8)
        for r in range(args.rounds):
            for way, (run, pid) in ways.items():
                served = process_cpu(pid) if pid else 0.0
                mine, start = time.process_time(), time.perf_counter()
                n = await run(args.tokens)
                seconds = time.perf_counter() - start
                mine = time.process_time() - mine
                served = process_cpu(pid) - served if pid else 0.0
                results[way].append(n / seconds)
                made[way].append(n)
                cpu[way].append((mine / n * 1e6, served / n * 1e6))
            print(
                f"round {r + 1}: "
                + "  ".join(f"{w} {v[-1]:,.0f}" for w, v in results.items()),
                flush=True,
            )
    ceiling = statistics.median(results["strict"])
    print(f"\n{args.rows} rows x {args.tokens} tokens, {args.rounds} rounds")
    print(
        f"{'way':>14} {'tokens/s (median)':>18} {'x strict':>8} {'tokens':>7} "
        f"{'CPU us/token: here':>19} {'server':>7}"
    )
    for way, values in results.items():
        median = statistics.median(values)
        here = statistics.median(c[0] for c in cpu[way])
        there = statistics.median(c[1] for c in cpu[way])
        print(
            f"{way:>14} {median:>18,.0f} {median / ceiling:>8.2f} "
            f"{statistics.median(made[way]):>7.0f} {here:>19.0f} {there:>7.0f}"
        )
    return {way: statistics.median(values) for way, values in results.items()}


def side_by_side(medians: dict[str, dict[str, float]]) -> None:
    """Each way's median tokens/s and its share of ``strict``'s, per size."""
    sizes = list(medians)
    print("\nside by side: tokens/s (x strict)")
    print(f"{'way':>14}" + "".join(f"{size:>22}" for size in sizes))
    for way in medians[sizes[0]]:
        cells = [
            f"{m[way]:,.0f} ({m[way] / m['strict']:.2f}x)" if way in m else "-"
            for m in medians.values()
        ]
        print(f"{way:>14}" + "".join(f"{cell:>22}" for cell in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--model",
        type=lambda folder: Path(folder).resolve(),  # each server has its cwd
        help="model folder (default: --size's qwen3)",
    )
    size_option(parser)
    parser.add_argument(
        "--windows",
        type=lambda text: [int(k) for k in text.split(",") if k],
        default=[8],
        help="bare loops that read every K steps (default: 8; '' for none)",
    )
    parser.add_argument(
        "--clients",
        type=lambda text: text.split(","),
        default=list(CLIENTS),
        help="the clients each server is measured with (default: %(default)s)",
    )
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
    parser.add_argument(
        "--compare-tree",
        action="append",
        type=lambda folder: Path(folder).resolve(),
        default=[],
        metavar="DIR",
        help="the same server run from another checkout (PYTHONPATH=DIR), in "
        "the same rounds, named after the folder",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.rows < 1 or args.tokens < 1:
        parser.error("--rows, --tokens and --rounds must be 1 or more")
    if not set(args.clients) <= set(CLIENTS):
        parser.error(f"--clients: some of {', '.join(CLIENTS)}")
    medians = {}
    for size in ["model"] if args.model else args.size:
        model = args.model or model_path(size, "qwen3")
        print(f"== {size}: {model}", flush=True)
        medians[size] = asyncio.run(main_async(args, model))
    if len(medians) > 1:
        side_by_side(medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
