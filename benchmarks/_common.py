"""What the server benchmarks share: the request, the models, quantiles,
ports, options."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

PROMPT = "Describe this image in one sentence."


def request_body(
    model: str, image_uri: str, max_tokens: int, *, stream: bool = False
) -> dict[str, Any]:
    """The bug report's request: the prompt and one image, greedy."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": PROMPT},
                    {"type": "image_url", "image_url": {"url": image_uri}},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile (p99 of 16 samples is their maximum)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def positive_ints(text: str) -> list[int]:
    """An option's comma-separated list of positive integers."""
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive ints")
    return values


#: The sizes of mlx_pinned.testing's models (docs/benchmarks.md says what
#: each stands for): ``tiny``, the server's own overhead; ``bench``, a
#: small real model's proportions.
SIZES = ("tiny", "bench")


def sizes(text: str) -> list[str]:
    """``--size``: ``tiny``, ``bench`` or both, comma-separated, in order."""
    values = [part for part in text.split(",") if part]
    if not values or not set(values) <= set(SIZES):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {SIZES}")
    return list(dict.fromkeys(values))


def size_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--size`` to a benchmark's options (``args.size``: a list)."""
    parser.add_argument(
        "--size",
        type=sizes,
        default=["tiny"],
        help="the model's size, or both side by side: tiny, bench or "
        "tiny,bench (default: tiny; --model overrides)",
    )


def model_path(size: str, model_type: str = "qwen3_vl") -> Path:
    """The family's model of ``size`` from mlx_pinned.testing (written on
    first use): a vision one, the omni ``gemma4``, or the text-only
    ``qwen3``."""
    from mlx_pinned import testing

    if model_type == "qwen3":
        return testing.bench_lm_path() if size == "bench" else testing.tiny_lm_path()
    if size == "bench":
        return testing.bench_vlm_path(model_type)
    if model_type in testing.TINY_OMNI_TYPES:
        return testing.tiny_omni_path(model_type)
    return testing.tiny_vlm_path(model_type)


@contextlib.contextmanager
def server(
    command: list[str], log: Path, stop_timeout: float = 20, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` in its own process group (in ``cwd``), its output in
    ``log``; at exit SIGTERM, then SIGKILL after ``stop_timeout`` seconds."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(stop_timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


async def wait_for(
    client: Any, process: subprocess.Popen[bytes], path: str, timeout: float
) -> Any:
    """Poll ``GET path`` until it answers 200 (503 while the model loads);
    the response."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        with contextlib.suppress(Exception):
            response = await client.get(path, timeout=2)
            if response.status_code == 200:
                return response
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the server did not answer {path} within {timeout:.0f} s")


async def sse_json(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's ``data:`` lines, in
    order; ``[DONE]`` and what is not a JSON object are passed over (the
    ``event:`` lines too: OpenAI's and Anthropic's events name their type in
    the object as well)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event
