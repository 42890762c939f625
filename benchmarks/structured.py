"""Structured outputs against free text: tokens/s at one concurrency.

Starts ``mlx-pinned serve`` once on the tiny model, then alternates rounds
of free requests and of ``response_format`` json_schema requests (the same
prompt and image, greedy, ``--max-tokens``), ``--concurrency`` at once, and
prints the completion tokens/s of each kind (median of the rounds) and
their ratio. Every schema'd answer is checked against the schema (answers
cut by ``max_tokens`` only for being a JSON prefix). Expensive: a quiet
machine, never CI.

::

    python benchmarks/structured.py [--concurrency 8] [--rounds 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import free_port, request_body, server, wait_for

SCHEMA = {
    "type": "object",
    "properties": {
        "caption": {"type": "string", "maxLength": 40},
        "objects": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "tree", "car", "sun"]},
            "maxItems": 4,
        },
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["caption", "objects", "count"],
    "additionalProperties": False,
}


async def one_round(
    client: Any, body: dict[str, Any], concurrency: int, requests: int
) -> tuple[float, int]:
    """Tokens/s of ``requests`` requests from ``concurrency`` workers, and
    how many schema'd answers failed to validate."""
    import jsonschema

    remaining, tokens, invalid = requests, 0, 0

    async def worker() -> None:
        nonlocal remaining, tokens, invalid
        while remaining > 0:
            remaining -= 1
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            data = response.json()
            tokens += int(data["usage"]["completion_tokens"])
            if "response_format" in body:
                choice = data["choices"][0]
                text = choice["message"]["content"]
                if choice["finish_reason"] == "stop":
                    try:
                        jsonschema.validate(json.loads(text), SCHEMA)
                    except (ValueError, jsonschema.ValidationError):
                        invalid += 1
                elif not text.startswith("{"):
                    invalid += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens / (time.perf_counter() - start), invalid


async def run(args: argparse.Namespace) -> int:
    import httpx

    from mlx_pinned.testing import image_data_uri, tiny_vlm_path

    port = free_port()
    command = [
        sys.executable, "-m", "mlx_pinned.server", "serve", str(tiny_vlm_path()),
        "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning",
        "--prompt-cache-bytes", "0",
    ]  # fmt: skip
    log = Path(tempfile.gettempdir()) / "structured-bench.log"
    free = request_body("tiny", image_data_uri(64, 64, "JPEG"), args.max_tokens)
    schema = {
        **free,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True},
        },
    }
    rates: dict[str, list[float]] = {"free": [], "json_schema": []}
    invalid = 0
    with server(command, log) as process:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=300
        ) as client:
            await wait_for(client, process, "/health", 180)
            for body in (free, schema):  # warm both paths
                await one_round(client, body, args.concurrency, args.concurrency)
            for index in range(args.rounds):
                for name, body in (("free", free), ("json_schema", schema)):
                    rate, bad = await one_round(
                        client, body, args.concurrency, args.requests
                    )
                    rates[name].append(rate)
                    invalid += bad
                    print(f"round {index} {name:<12} {rate:8.1f} tok/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"\nconcurrency {args.concurrency}, {args.max_tokens} tokens: free "
        f"{medians['free']:.1f} tok/s, json_schema {medians['json_schema']:.1f} "
        f"tok/s, ratio {medians['json_schema'] / medians['free']:.2f}x; "
        f"invalid schema'd answers: {invalid}"
    )
    return 0 if invalid == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
