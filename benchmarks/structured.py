"""Structured outputs against free text: tokens/s at one concurrency.

Starts ``mlx-pinned serve`` once on the tiny model, then alternates rounds
of three kinds of requests (the same prompt and image, greedy, the same
``--max-tokens``), ``--concurrency`` at once, and prints the completion
tokens/s of each kind (median of the rounds), the completion tokens per
request (from ``usage``), and the ratios to free:

- ``free``: no ``response_format``; the random-weight model never ends its
  turn, so every answer is ``max_tokens`` long;
- ``json_schema``: a ``response_format`` json_schema whose caption may be
  longer than ``max_tokens``, so its answers are as long as the free ones
  (cut by ``max_tokens``: a JSON prefix). Same tokens per request, same
  prefills: the ratio measures what a constrained token costs;
- ``json_schema_closed``: a schema with a short caption, so every answer is
  a complete object that ends before ``max_tokens``: fewer tokens per
  request, so each request's fixed costs (its prefill, its HTTP round trip)
  weigh more in its tokens/s.

Answers are checked after each round, outside its timed window (a
jsonschema check takes milliseconds of the client's CPU, which the server
shares, and would hold back the client's next request): complete ones
against the schema, cut ones for being a JSON object's beginning.
Expensive: a quiet machine, never CI.

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

OBJECTS = {
    "type": "array",
    "items": {"enum": ["cat", "dog", "tree", "car", "sun"]},
    "maxItems": 4,
}
COUNT = {"type": "integer", "minimum": 0, "maximum": 20}


def scene(caption_chars: int) -> dict[str, Any]:
    """The benchmark's schema, its caption at most ``caption_chars`` long."""
    return {
        "type": "object",
        "properties": {
            "caption": {"type": "string", "maxLength": caption_chars},
            "objects": OBJECTS,
            "count": COUNT,
        },
        "required": ["caption", "objects", "count"],
        "additionalProperties": False,
    }


#: Answers as long as ``max_tokens`` (a caption token is a character or more).
SCHEMA = scene(2000)
#: Answers that close early (the tiny model's: 54 tokens).
SCHEMA_CLOSED = scene(40)
KINDS = ("free", "json_schema", "json_schema_closed")


async def one_round(
    client: Any, body: dict[str, Any], concurrency: int, requests: int
) -> tuple[float, list[dict[str, Any]]]:
    """Completion tokens/s of ``requests`` requests from ``concurrency``
    workers, and their answers (read, not checked, inside the window)."""
    remaining = requests
    answers: list[dict[str, Any]] = []

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            answers.append(response.json())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    tokens = sum(int(a["usage"]["completion_tokens"]) for a in answers)
    return tokens / seconds, answers


def invalid_answers(answers: list[dict[str, Any]], schema: dict[str, Any]) -> int:
    """How many answers break ``schema``: a complete one that does not
    validate, or a cut one (``length``) that does not begin an object."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    invalid = 0
    for answer in answers:
        choice = answer["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            try:
                validator.validate(json.loads(text))
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
        elif choice["finish_reason"] != "length" or not text.startswith("{"):
            invalid += 1
    return invalid


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
    schemas = {"json_schema": SCHEMA, "json_schema_closed": SCHEMA_CLOSED}
    bodies = {"free": free} | {
        name: {
            **free,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "scene", "schema": schema, "strict": True},
            },
        }
        for name, schema in schemas.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in KINDS}
    lengths: dict[str, list[int]] = {name: [] for name in KINDS}
    stops: dict[str, int] = dict.fromkeys(KINDS, 0)
    invalid = 0
    with server(command, log) as process:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=300
        ) as client:
            await wait_for(client, process, "/health", 180)
            for body in bodies.values():  # warm every path
                await one_round(client, body, args.concurrency, args.concurrency)
            for index in range(args.rounds):
                for name in KINDS:
                    rate, answers = await one_round(
                        client, bodies[name], args.concurrency, args.requests
                    )
                    rates[name].append(rate)
                    lengths[name] += [a["usage"]["completion_tokens"] for a in answers]
                    stops[name] += sum(
                        a["choices"][0]["finish_reason"] == "stop" for a in answers
                    )
                    if name in schemas:
                        invalid += invalid_answers(answers, schemas[name])
                    print(f"round {index} {name:<18} {rate:8.1f} tok/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(f"\nconcurrency {args.concurrency}, max_tokens {args.max_tokens}:")
    for name in KINDS:
        print(
            f"  {name:<18} {medians[name]:8.1f} tok/s, "
            f"{statistics.mean(lengths[name]):5.1f} tokens a request, "
            f"{stops[name]}/{len(lengths[name])} ended by themselves, "
            f"{medians[name] / medians['free']:.2f}x free"
        )
    print(f"  invalid schema'd answers: {invalid}")
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
