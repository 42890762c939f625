"""The answer as Anthropic writes it, and Anthropic's error shape. Event
loop (pure CPU). A whole answer (:class:`Blocks`) and a stream
(:class:`EventWriter`) are made from the same parts of the answer parser;
errors keep the shared table's messages with Anthropic's statuses and
types (docs/anthropic.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_pinned import MLXThreadBusyError

from ...events import FinalEvent
from ...failures import OverloadedError
from ...formats import CallStart
from ..answer_parser import Part, Reasoning, arguments_object
from ..errors import APIError, api_error
from ..wire import random_hex, sse_event

__all__ = [
    "ANTHROPIC_ERRORS",
    "PING",
    "AnthropicErrors",
    "Blocks",
    "EventWriter",
    "StopReason",
    "error_type",
    "message_id",
    "stop_reason",
    "tool_use_id",
]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def message_id() -> str:
    return f"msg_{random_hex(96)}"


def tool_use_id() -> str:
    return f"toolu_{random_hex(96)}"


def stop_reason(final: FinalEvent, *, called: bool) -> StopReason:
    """The engine's reason as Anthropic's: a turn that called tools and
    ended by itself ended with ``tool_use``; one a stop string ended, with
    ``stop_sequence``."""
    if final.finish_reason == "length":
        return "max_tokens"
    if final.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


@dataclass
class Blocks:
    """The parts of a whole answer, collected into content blocks
    (``shown``: whether thinking blocks carry their text)."""

    shown: bool = True
    blocks: list[dict[str, Any]] = field(default_factory=list)
    # Each call's block (its position in blocks) and its arguments.
    _calls: dict[int, tuple[int, list[str]]] = field(default_factory=dict)

    def add(self, parts: list[Part]) -> None:
        for part in parts:
            last = self.blocks[-1] if self.blocks else None
            if isinstance(part, Reasoning):
                if last is None or last["type"] != "thinking":
                    last = {"type": "thinking", "thinking": "", "signature": ""}
                    self.blocks.append(last)
                if self.shown:
                    last["thinking"] += part.text
            elif isinstance(part, str):
                if not part:
                    continue
                if last is None or last["type"] != "text":
                    last = {"type": "text", "text": ""}
                    self.blocks.append(last)
                last["text"] += part
            elif isinstance(part, CallStart):
                block = {"type": "tool_use", "id": part.id, "name": part.name}
                self.blocks.append({**block, "input": {}})
                self._calls[part.index] = (len(self.blocks) - 1, [])
            else:
                self._calls[part.index][1].append(part.text)

    def content(self) -> list[dict[str, Any]]:
        out = [dict(block) for block in self.blocks]
        for position, arguments in self._calls.values():
            out[position]["input"] = arguments_object("".join(arguments))
        return out


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return sse_event({"type": kind, **data}, event=kind)


#: Anthropic's keep-alive, which its clients skip.
PING = _event("ping", {})


class EventWriter:
    """The server-sent events of one answer, block by block.

    States: no block open; a ``text``, ``thinking`` or ``tool_use`` block
    open at ``index``. A part of another kind closes the open block and
    opens its own.
    """

    def __init__(self, *, shown: bool = True) -> None:
        self.shown = shown
        self.index = -1
        self.open: str | None = None

    @staticmethod
    def start(id: str, model: str) -> bytes:
        """``message_start`` (its usage is known only at the end: see
        ``message_delta``) and a ``ping``."""
        message: dict[str, Any] = {
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"message": message}) + PING

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.open = kind
        start = {"index": self.index, "content_block": block}
        return out + _event("content_block_start", start)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event("content_block_stop", {"index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def parts(self, parts: list[Part]) -> bytes:
        out = []
        for part in parts:
            if isinstance(part, Reasoning):
                if self.open != "thinking":
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    out.append(self._open("thinking", block))
                if self.shown:
                    delta = {"type": "thinking_delta", "thinking": part.text}
                    out.append(self._delta(delta))
            elif isinstance(part, str):
                if not part:
                    continue
                if self.open != "text":
                    out.append(self._open("text", {"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": part}))
            elif isinstance(part, CallStart):
                block = {"type": "tool_use", "id": part.id, "name": part.name}
                out.append(self._open("tool_use", {**block, "input": {}}))
            elif part.text:
                delta = {"type": "input_json_delta", "partial_json": part.text}
                out.append(self._delta(delta))
        return b"".join(out)

    def end(self, reason: StopReason, final: FinalEvent) -> bytes:
        """The open block's end, ``message_delta`` and ``message_stop``."""
        delta = {"stop_reason": reason, "stop_sequence": final.stop_sequence}
        usage = {
            "input_tokens": final.prompt_tokens,
            "output_tokens": final.completion_tokens,
        }
        return (
            self._close()
            + _event("message_delta", {"delta": delta, "usage": usage})
            + _event("message_stop", {})
        )


_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for a status (``api_error`` for the rest
    of the 5xx, ``invalid_request_error`` for the rest of the 4xx)."""
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicErrors:
    """Anthropic's shape: ``{"type": "error", "error": {...}}``, and an
    ``event: error`` of it."""

    def answer(
        self,
        exc: BaseException,
        *,
        retry_after: int,
        places: Sequence[str] = (),
        prompt: str = "messages",
    ) -> APIError | None:
        """The answer for a known failure in this API's statuses; None for a
        bug (the base logs it and answers a 500)."""
        error = api_error(exc, retry_after=retry_after, places=places, prompt=prompt)
        if error is not None and isinstance(exc, OverloadedError | MLXThreadBusyError):
            return APIError(529, error.message, code=error.code, headers=error.headers)
        return error

    def body(self, error: APIError) -> bytes:
        inner = {"type": error_type(error.status), "message": error.message}
        return json.dumps({"type": "error", "error": inner}).encode()

    def event(self, error: APIError) -> bytes:
        return b"event: error\ndata: " + self.body(error) + b"\n\n"


ANTHROPIC_ERRORS = AnthropicErrors()
