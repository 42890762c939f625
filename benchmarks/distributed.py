"""Tensor parallelism over the ring on loopback against one process.

The demo model served by ``serve --demo`` in one process, and by a group of
two ranks (``--distributed tensor``, each started with ``MLX_RANK`` and
``MLX_HOSTFILE``, rank 0 on HTTP). The same greedy request (a 64x64 image,
``max_tokens`` tokens) is sent at each concurrency to each; tokens/s and
the group's ratio to one process are printed, per round and as medians.
Both run on this one machine and share its CPUs, so this measures what the
collectives cost on loopback, not what several machines would give.

::

    python benchmarks/distributed.py [--rounds 3] [--tokens 32] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mlx_pinned.testing import image_data_uri, tiny_vlm_path


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def start(folder: Path, ranks: int) -> tuple[list[subprocess.Popen[bytes]], str]:
    """``serve --demo`` alone (``ranks`` 1) or as a group; waits for /health."""
    http, *ring = free_ports(1 + ranks)
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", "--demo"]
    command += ["--port", str(http), "--max-num-seqs", "32"]
    envs = [dict(os.environ)]
    if ranks > 1:
        hostfile = folder / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ring]))
        command += ["--distributed", "tensor"]
        envs = [
            dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            for rank in range(ranks)
        ]
    processes = [
        subprocess.Popen(
            command,
            env=env,
            stdout=(folder / f"rank{rank}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for rank, env in enumerate(envs)
    ]
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 180
    while True:
        assert all(p.poll() is None for p in processes), "a rank exited"
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return processes, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def stop(processes: list[subprocess.Popen[bytes]]) -> list[int]:
    processes[0].send_signal(signal.SIGTERM)
    return [p.wait(60) for p in processes]


def tokens_per_second(url: str, concurrency: int, tokens: int, requests: int) -> float:
    body = {
        "model": "mlx-pinned-demo",
        "max_tokens": tokens,
        "temperature": 0.0,
        "logit_bias": {"0": -100, "2": -100},  # every answer has `tokens`
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_data_uri()}},
                    {"type": "text", "text": "Describe this image in one sentence."},
                ],
            }
        ],
    }

    def one(client: httpx.Client) -> int:
        answer = client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        answer.raise_for_status()
        return int(answer.json()["usage"]["completion_tokens"])

    clients = [httpx.Client() for _ in range(concurrency)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, clients))  # warm up
        begin = time.perf_counter()
        futures = [pool.submit(one, clients[i % concurrency]) for i in range(requests)]
        done = sum(f.result() for f in futures)
        seconds = time.perf_counter() - begin
    for client in clients:
        client.close()
    return done / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tiny_vlm_path()  # written once, before both read it
    ratios: dict[int, list[float]] = {c: [] for c in levels}
    rates: dict[tuple[int, int], list[float]] = {}
    for round_ in range(args.rounds):
        for ranks in (1, 2):
            with tempfile.TemporaryDirectory() as folder:
                processes, url = start(Path(folder), ranks)
                try:
                    for level in levels:
                        rate = tokens_per_second(url, level, args.tokens, 4 * level)
                        rates.setdefault((ranks, level), []).append(rate)
                finally:
                    statuses = stop(processes)
                assert statuses == [0] * ranks, statuses
        for level in levels:
            ratio = rates[(2, level)][-1] / rates[(1, level)][-1]
            ratios[level].append(ratio)
            print(
                f"round {round_ + 1} c{level}: one process "
                f"{rates[(1, level)][-1]:.0f} tok/s, 2 ranks "
                f"{rates[(2, level)][-1]:.0f} tok/s ({ratio:.2f}x)",
                flush=True,
            )
    for level in levels:
        print(
            f"median c{level}: one process "
            f"{statistics.median(rates[(1, level)]):.0f} tok/s, 2 ranks "
            f"{statistics.median(rates[(2, level)]):.0f} tok/s "
            f"({statistics.median(ratios[level]):.2f}x)"
        )


if __name__ == "__main__":
    main()
