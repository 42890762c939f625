"""Stored responses, in memory, within a bound: for ``GET`` and ``DELETE
/v1/responses/{id}``, its ``input_items``, and ``previous_response_id``.

Event loop only (no locks: every read and write is on the loop). A stored
response keeps its JSON, its input items as sent, and the conversation it
ended (chat messages and image URLs), so a turn that continues it renders
the same prefix and the engine's prompt cache serves it. The bound is a
count and a size in bytes; past either, the oldest go first.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["ResponseStore", "StoredResponse"]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: The response object, as ``GET`` answers it.
        input_items: Its input items (with ids), as ``input_items`` lists them.
        messages: The conversation it ended, without its instructions: the
            chat messages of the turns before, of its input and of its output.
        images: The URLs of the images in ``messages``, in order.
        size: Bytes it is counted as.
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: tuple[dict[str, Any], ...]
    images: tuple[str, ...]
    size: int


class ResponseStore:
    """Responses by id, oldest out first past ``max_count`` or ``max_bytes``.

    Args:
        max_count: Most responses kept (0: none).
        max_bytes: Most bytes kept, counted as their JSON's length; a response
            larger than this alone is not kept.
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._kept.get(response_id)

    def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: tuple[dict[str, Any], ...],
        images: tuple[str, ...],
    ) -> bool:
        """Keep a response; whether it was kept (it fits the bound)."""
        size = sum(
            len(json.dumps(part, ensure_ascii=False, default=str))
            for part in (response, input_items, messages, images)
        )
        if self.max_count < 1 or size > self.max_bytes:
            return False
        self.delete(response["id"])
        stored = StoredResponse(response, input_items, messages, images, size)
        self._kept[response["id"]] = stored
        self.bytes += size
        while len(self._kept) > self.max_count or self.bytes > self.max_bytes:
            _, oldest = self._kept.popitem(last=False)
            self.bytes -= oldest.size
        return True

    def delete(self, response_id: str) -> bool:
        """Drop a response; whether it was there."""
        stored = self._kept.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True
