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
        [--images]

``--images`` sends 64x64 PNG images as ``image_url`` parts in ``input``
(each its own vector; mlx-vlm's server takes the same body) to the tiny
Qwen3-VL-Embedding (or ``--model``) instead of sentences.

``--systems mlx-pinned,mlx-vlm,vllm-mlx`` runs each in turn on the same
folder, one after the other in one run, and prints their embeddings/s
side by side: mlx-vlm's own server (``python -m mlx_vlm.server
--embedding-model DIR``) and vllm-mlx's (``vllm-mlx serve CHAT_DIR
--embedding-model DIR``; it needs a chat model too: the tiny Qwen3) from
the peers' own venv (``--peers-venv``, as benchmarks/peers.py documents).
vllm-mlx loads embeddings with mlx-embeddings, whose BERT has a pooler
layer: the tiny model is copied with one (random, unused by the mean
pooling all three do), so every system serves the same folder and gives
the same vectors.

It needs ``httpx`` beside mlx-pinned. Run it on a quiet machine; the
figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
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


#: Distinct images the ``--images`` requests take in turn.
IMAGE_POOL = 64


def body(name: str, inputs: int, seed: int, images: bool = False) -> dict[str, Any]:
    """``inputs`` sentences, numbered so no two requests are alike; or
    ``inputs`` image parts taken in turn from the pool."""
    if images:
        urls = image_pool()
        parts = [
            {"type": "image_url", "image_url": {"url": urls[(seed + i) % IMAGE_POOL]}}
            for i in range(inputs)
        ]
        return {"model": name, "input": parts, "encoding_format": "float"}
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {seed}-{i}" for i in range(inputs)]
    return {"model": name, "input": texts, "encoding_format": "float"}


@functools.cache
def image_pool() -> tuple[str, ...]:
    from mlx_pinned.testing import image_data_uri

    return tuple(image_data_uri(64, 64, "PNG", seed=i) for i in range(IMAGE_POOL))


async def level(
    client: httpx.AsyncClient,
    name: str,
    concurrency: int,
    seconds: float,
    inputs: int,
    images: bool = False,
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
                "/v1/embeddings",
                json=body(name, inputs, index * 10**6 + sent, images),
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
def own_server(model: str | None, images: bool) -> Iterator[tuple[str, str, Any]]:
    """mlx-pinned serving ``model`` (the tiny one by default, its image
    embedder with ``images``) as ``emb``: its URL, the name and its process."""
    from mlx_pinned.testing import tiny_embedding_path

    tiny = tiny_embedding_path("qwen3_vl_embedding" if images else "bert")
    folder = model or str(tiny)
    port = free_port()
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", folder]
    command += ["--model-kind", "embedding", "--served-model-name", "emb"]
    command += ["--port", str(port), "--max-num-seqs", "64"]
    log = Path(tempfile.mkdtemp()) / "server.log"
    with server(command, log) as process:
        yield f"http://127.0.0.1:{port}", "emb", process


@contextlib.contextmanager
def peer_server(system: str, folder: str, venv: Path) -> Iterator[tuple[str, str, Any]]:
    """mlx-vlm's or vllm-mlx's server on ``folder``, from ``venv``."""
    from mlx_pinned.testing import tiny_lm_path

    port = free_port()
    if system == "mlx-vlm":
        command = [str(venv / "bin" / "python"), "-m", "mlx_vlm.server"]
        command += ["--embedding-model", folder, "--port", str(port)]
    else:
        command = [str(venv / "bin" / "vllm-mlx"), "serve", str(tiny_lm_path())]
        command += ["--embedding-model", folder, "--port", str(port)]
    log = Path(tempfile.mkdtemp()) / f"{system}.log"
    with server(command, log) as process:
        yield f"http://127.0.0.1:{port}", folder, process


def with_pooler(folder: str) -> str:
    """A copy of ``folder`` with a BERT pooler layer (what mlx-embeddings,
    vllm-mlx's loader, needs), in a temporary folder."""
    import shutil

    import mlx.core as mx
    import numpy as np

    copy = Path(tempfile.mkdtemp()) / "embedding"
    shutil.copytree(folder, copy)
    weights = mx.load(str(copy / "model.safetensors"))
    assert isinstance(weights, dict)
    width = weights["embeddings.word_embeddings.weight"].shape[1]
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((width, width)).astype(np.float32) / width**0.5
    weights["pooler.dense.weight"] = mx.array(dense)
    weights["pooler.dense.bias"] = mx.zeros((width,))
    mx.save_safetensors(str(copy / "model.safetensors"), weights)
    return str(copy)


async def run(
    args: argparse.Namespace, system: str = "mlx-pinned"
) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        if args.url:
            url, name, process = args.url, args.name, None
        elif system == "mlx-pinned":
            url, name, process = stack.enter_context(
                own_server(args.model, args.images)
            )
        else:
            if args.peers_venv is None:
                raise SystemExit(f"{system} needs --peers-venv")
            peer = peer_server(system, args.model, args.peers_venv)
            url, name, process = stack.enter_context(peer)
        limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
        async with httpx.AsyncClient(
            base_url=url, timeout=120, limits=limits
        ) as client:
            if process is not None:
                await wait_for(client, process, "/v1/models", 180)
            await level(client, name, 1, 1.0, args.inputs, args.images)  # warm-up
            return [
                await level(client, name, c, args.seconds, args.inputs, args.images)
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
    parser.add_argument(
        "--systems", default="mlx-pinned", help="mlx-pinned,mlx-vlm,vllm-mlx"
    )
    parser.add_argument("--peers-venv", type=Path, help="the peers' own venv")
    parser.add_argument(
        "--images", action="store_true", help="embed images, not sentences"
    )
    args = parser.parse_args()
    systems = args.systems.split(",")
    if systems != ["mlx-pinned"]:
        from mlx_pinned.testing import tiny_embedding_path

        if args.images:  # the same Qwen3-VL-Embedding folder for every system
            tiny = tiny_embedding_path("qwen3_vl_embedding")
            args.model = args.model or str(tiny)
        else:
            args.model = with_pooler(args.model or str(tiny_embedding_path()))
    results = {system: asyncio.run(run(args, system)) for system in systems}
    print("system      concurrency  requests  embeddings/s  p50 ms  p99 ms  errors")
    for system, rows in results.items():
        for row in rows:
            print(
                f"{system:<11} {row['concurrency']:>11}  {row['requests']:>8}  "
                f"{row['embeddings_per_second']:>12.1f}  "
                f"{row['p50_seconds'] * 1000:>6.1f}  "
                f"{row['p99_seconds'] * 1000:>6.1f}  {row['errors']:>6}"
            )
    first = results[systems[0]]
    for system in systems[1:]:
        ratios = []
        for mine, theirs in zip(first, results[system], strict=True):
            ratio = mine["embeddings_per_second"] / theirs["embeddings_per_second"]
            ratios.append(f"c{mine['concurrency']} {ratio:.2f}x")
        print(f"{systems[0]} / {system}: " + ", ".join(ratios))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
