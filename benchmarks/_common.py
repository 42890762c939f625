"""What the server benchmarks share: the request, quantiles, ports, options."""

from __future__ import annotations

import argparse
import math
import socket
from collections.abc import Sequence
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
