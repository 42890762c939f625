"""The answer as Ollama writes it: NDJSON lines (or one JSON object), its
counts and durations, and Ollama's error shape. Event loop (pure CPU).

A tool call goes out whole, its arguments an object, once its text has
ended; an error that ends a stream already begun is a last line of the
error shape."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ...events import FinalEvent, TokenLogprobs
from ...formats import CallStart
from ..answer_parser import Part, Reasoning, arguments_object
from ..errors import APIError, OpenAIErrors

__all__ = [
    "NDJSON",
    "OLLAMA_ERRORS",
    "OllamaErrors",
    "Turn",
    "created_at",
    "embed_metrics",
    "line",
    "logprob",
    "metrics",
]

NDJSON = b"application/x-ndjson"


def created_at(unix: float | None = None) -> str:
    """``unix`` (now, if None) as Ollama's timestamps: UTC, ISO 8601."""
    moment = datetime.fromtimestamp(time.time() if unix is None else unix, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def line(data: dict[str, Any]) -> bytes:
    """One NDJSON line of compact JSON."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def logprob(entry: TokenLogprobs) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": entry.bytes,
        "top_logprobs": [
            {"token": token, "logprob": value, "bytes": raw}
            for token, value, raw in entry.top
        ],
    }


def metrics(final: FinalEvent, start: float, load_seconds: float) -> dict[str, Any]:
    """The final object's counts, and its durations in nanoseconds:
    ``total_duration`` from the request's arrival (``start``, on
    ``time.perf_counter``), ``load_duration`` the wait for the model's load,
    the others as the MLX thread measured its prefill and decode."""
    return {
        "total_duration": round((time.perf_counter() - start) * 1e9),
        "load_duration": round(load_seconds * 1e9),
        "prompt_eval_count": final.prompt_tokens,
        "prompt_eval_duration": round(final.prefill_seconds * 1e9),
        "eval_count": final.completion_tokens,
        "eval_duration": round(final.decode_seconds * 1e9),
    }


def embed_metrics(tokens: int, start: float, load_seconds: float) -> dict[str, Any]:
    """An embedding's counts and durations, as :func:`metrics`'s."""
    return {
        "total_duration": round((time.perf_counter() - start) * 1e9),
        "load_duration": round(load_seconds * 1e9),
        "prompt_eval_count": tokens,
    }


@dataclass
class Turn:
    """The answer's parts, sorted into Ollama's message fields; a stream
    takes each piece's text with :meth:`take` and the calls at the end."""

    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    _calls: dict[int, tuple[str, list[str]]] = field(default_factory=dict)

    def add(self, parts: Sequence[Part]) -> None:
        for part in parts:
            if isinstance(part, Reasoning):
                self.thinking.append(part.text)
            elif isinstance(part, str):
                self.content.append(part)
            elif isinstance(part, CallStart):
                self._calls[part.index] = (part.name, [])
            else:
                self._calls[part.index][1].append(part.text)

    def calls(self) -> list[dict[str, Any]]:
        return [
            {
                "function": {
                    "index": index,
                    "name": name,
                    "arguments": arguments_object("".join(text)),
                }
            }
            for index, (name, text) in sorted(self._calls.items())
        ]

    def message(self) -> dict[str, Any]:
        """The message of everything added (the whole answer's)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content),
        }
        if self.thinking:
            message["thinking"] = "".join(self.thinking)
        if self._calls:
            message["tool_calls"] = self.calls()
        return message

    def take(self) -> tuple[str, str]:
        """The content and thinking added since the last take."""
        taken = "".join(self.content), "".join(self.thinking)
        self.content.clear()
        self.thinking.clear()
        return taken


class OllamaErrors(OpenAIErrors):
    """Ollama's shape: ``{"error": "..."}``, and the same as an NDJSON line
    that ends a stream; the statuses of OpenAI's table."""

    def body(self, error: APIError) -> bytes:
        return json.dumps({"error": error.message}).encode()

    def event(self, error: APIError) -> bytes:
        return self.body(error) + b"\n"


OLLAMA_ERRORS = OllamaErrors()
