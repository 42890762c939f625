"""One server-sent event as bytes: compact JSON after ``data:``, named by
``event:`` where the API names its events.

Event loop (pure CPU), once per event of a stream; every API's stream
writes its events through :func:`sse_event`.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["sse_event"]


def sse_event(data: Any, *, event: str | None = None) -> bytes:
    """``data`` as JSON (not ASCII-escaped, no spaces) in one event, with an
    ``event:`` line first when ``event`` is given."""
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if event is None:
        return f"data: {body}\n\n".encode()
    return f"event: {event}\ndata: {body}\n\n".encode()
