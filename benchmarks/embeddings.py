"""Embeddings per second through ``POST /v1/embeddings``, at each concurrency.

Starts mlx-pinned's server on a free loopback port on the tiny embedding
model of ``mlx_pinned.testing`` (or ``--model FOLDER``), or uses a server
already running (``--url``, ``--name``: any OpenAI-compatible one, such as
mlx-vlm's own server or vllm-mlx's, on the same model folder), warms it up,
then keeps ``c`` clients sending the same request (``--inputs`` short
sentences, each a little different) for ``--seconds`` at each concurrency.
Per concurrency it prints requests answered, embeddings/s (inputs embedded
per second, all clients together), p50/p99 latency and errors, and writes
the figures as JSON (``--json``)::

    python benchmarks/embeddings.py [--concurrency 1,16] [--seconds 10]
        [--inputs 8] [--model FOLDER] [--url URL --name NAME] [--json OUT]

It needs ``httpx`` beside mlx-pinned. Run it on a quiet machine; the
figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import free_port, positive_ints, quantile, server, wait_for

SENTENCES = (
    "A small red square sits on a blue background.",
    "There is a cat on the table next to a cup of tea.",
    "Green trees, white clouds, yellow sun and a grey road.",
    "The quick brown fox jumps over the lazy dog.",
)


def body(name: str, inputs: int, seed: int) -> dict[str, Any]:
    """``inputs`` sentences, numbered so no two requests are alike."""
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {seed}-{i}" for i in range(inputs)]
    return {"model": name, "input": texts, "encoding_format": "float"}


async def level(
    client: httpx.AsyncClient, name: str, concurrency: int, seconds: float, inputs: int
) -> dict[str, Any]:
    """``concurrency`` clients for ``seconds``: the level's figures."""
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def one_client(index: int) -> None:
        nonlocal errors
        sent = 0
        while time.perf_counter() < stop:
            start = time.perf_counter()
            response = await client.post(
                "/v1/embeddings", json=body(name, inputs, index * 10**6 + sent)
            )
            sent += 1
            if response.status_code == 200:
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1

    began = time.perf_counter()
    await asyncio.gather(*(one_client(index) for index in range(concurrency)))
    elapsed = time.perf_counter() - began
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "embeddings_per_second": len(latencies) * inputs / elapsed,
        "p50_seconds": quantile(latencies, 0.5),
        "p99_seconds": quantile(latencies, 0.99),
        "errors": errors,
    }


@contextlib.contextmanager
def own_server(model: str | None) -> Iterator[tuple[str, str, Any]]:
    """mlx-pinned serving ``model`` (the tiny one by default) as ``emb``:
    its URL, the name and its process."""
    from mlx_pinned.testing import tiny_embedding_path

    folder = model or str(tiny_embedding_path())
    port = free_port()
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", folder]
    command += ["--model-kind", "embedding", "--served-model-name", "emb"]
    command += ["--port", str(port), "--max-num-seqs", "64"]
    log = Path(tempfile.mkdtemp()) / "server.log"
    with server(command, log) as process:
        yield f"http://127.0.0.1:{port}", "emb", process


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        if args.url:
            url, name, process = args.url, args.name, None
        else:
            url, name, process = stack.enter_context(own_server(args.model))
        limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
        async with httpx.AsyncClient(
            base_url=url, timeout=120, limits=limits
        ) as client:
            if process is not None:
                await wait_for(client, process, "/health", 120)
            await level(client, name, 1, 1.0, args.inputs)  # warm-up
            return [
                await level(client, name, c, args.seconds, args.inputs)
                for c in args.concurrency
            ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 16])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--inputs", type=int, default=8)
    parser.add_argument("--model", help="an embedding model folder (mlx-pinned)")
    parser.add_argument("--url", help="a running server instead of mlx-pinned's")
    parser.add_argument("--name", default="emb", help="its model name (--url)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print("concurrency  requests  embeddings/s  p50 ms  p99 ms  errors")
    for row in results:
        print(
            f"{row['concurrency']:>11}  {row['requests']:>8}  "
            f"{row['embeddings_per_second']:>12.1f}  "
            f"{row['p50_seconds'] * 1000:>6.1f}  {row['p99_seconds'] * 1000:>6.1f}  "
            f"{row['errors']:>6}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
