"""Stored responses, within a bound of a count and bytes (past either, the
oldest go first): in memory, or in SQLite under ``state_dir``.

Event loop; the SQLite backing's queries run on a worker thread. A stored
response keeps the conversation it ended, so a turn that continues it
renders the same prefix and the engine's prompt cache serves it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...config import ServerConfig

__all__ = [
    "DamagedResponseError",
    "Entry",
    "Ledger",
    "MemoryStore",
    "ResponseStore",
    "StoredResponse",
    "encoded",
    "open_store",
]


class DamagedResponseError(Exception):
    """A stored response cannot be read back (its stored copy is damaged);
    the rest of the store is unaffected."""

    def __init__(self, response_id: str, why: str) -> None:
        super().__init__(f"stored response {response_id} cannot be read: {why}")
        self.response_id = response_id


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response; ``messages`` is the conversation it ended,
    without its instructions, and ``images`` their URLs, in order."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: tuple[dict[str, Any], ...]
    images: tuple[str, ...]
    size: int


def encoded(
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    messages: tuple[dict[str, Any], ...],
    images: tuple[str, ...],
) -> tuple[str, ...]:
    """The four parts of a response as JSON; their lengths add up to its
    size (the same count for every backing)."""
    parts = (response, input_items, messages, images)
    return tuple(json.dumps(part, ensure_ascii=False, default=str) for part in parts)


@dataclass(frozen=True, slots=True)
class Entry:
    size: int
    image_count: int


class Ledger:
    """The stored responses' sizes and image counts by id, oldest first:
    the one place the bound is kept, for every backing."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def fits(self, size: int) -> bool:
        return self.max_count >= 1 and size <= self.max_bytes

    def evicted_by(self, response_id: str, size: int) -> list[str]:
        """The oldest responses that must go for ``response_id`` (``size``
        bytes) to be kept, oldest first (a response it replaces not
        among them); nothing changes yet."""
        replaced = self.entries.get(response_id)
        count = len(self.entries) + (replaced is None)
        total = self.bytes + size - (replaced.size if replaced else 0)
        return self._oldest_past(count, total, keep=response_id)

    def over(self) -> list[str]:
        """The oldest responses past the bound (those read back from disk
        under a smaller bound), oldest first; nothing changes yet."""
        return self._oldest_past(len(self.entries), self.bytes, keep=None)

    def _oldest_past(self, count: int, total: int, keep: str | None) -> list[str]:
        out: list[str] = []
        for old_id, entry in self.entries.items():
            if count <= self.max_count and total <= self.max_bytes:
                break
            if old_id != keep:
                out.append(old_id)
                count -= 1
                total -= entry.size
        return out

    def add(self, response_id: str, entry: Entry) -> None:
        self.remove(response_id)
        self.entries[response_id] = entry
        self.bytes += entry.size

    def remove(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None


class ResponseStore(ABC):
    """Responses by id, oldest out first past ``max_count`` or ``max_bytes``
    (counted as their JSON's length; 0 responses: none kept).

    Called on the event loop; a write is whole or not at all, and is
    durable once it returns.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.max_count = ledger.max_count
        self.max_bytes = ledger.max_bytes
        self._ledger = ledger

    @property
    def bytes(self) -> int:
        return self._ledger.bytes

    def __len__(self) -> int:
        return len(self._ledger.entries)

    def image_count(self, response_id: str) -> int | None:
        """How many images a stored response's conversation has (None: not
        stored), without waiting: where each image of a turn that continues
        it is named."""
        entry = self._ledger.entries.get(response_id)
        return None if entry is None else entry.image_count

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """None where none is stored; a ``DamagedResponseError`` where one
        is stored and cannot be read back."""

    @abstractmethod
    async def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: tuple[dict[str, Any], ...],
        images: tuple[str, ...],
    ) -> bool:
        """Keep a response (one of the same id is replaced); whether it was
        kept (it fits the bound, and could be written: a full disk is a
        False, logged)."""

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Whether it was there."""

    @abstractmethod
    async def aclose(self) -> None:
        """Let go of what the store holds open."""


class MemoryStore(ResponseStore):
    """The store in this process's memory: a restart forgets it."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        super().__init__(Ledger(max_count, max_bytes))
        self._kept: dict[str, StoredResponse] = {}

    async def get(self, response_id: str) -> StoredResponse | None:
        return self._kept.get(response_id)

    async def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: tuple[dict[str, Any], ...],
        images: tuple[str, ...],
    ) -> bool:
        size = sum(map(len, encoded(response, input_items, messages, images)))
        if not self._ledger.fits(size):
            return False
        for old_id in self._ledger.evicted_by(response["id"], size):
            await self.delete(old_id)
        stored = StoredResponse(response, input_items, messages, images, size)
        self._kept[response["id"]] = stored
        self._ledger.add(response["id"], Entry(size, len(images)))
        return True

    async def delete(self, response_id: str) -> bool:
        self._kept.pop(response_id, None)
        return self._ledger.remove(response_id)

    async def aclose(self) -> None:
        """Nothing is held open in memory."""


def open_store(config: ServerConfig) -> ResponseStore:
    """The store of ``config``, opened and checked now, on the caller's
    thread; a ``SettingError`` where ``state_dir`` cannot hold it."""
    bound = (config.responses_store_max, config.responses_store_bytes)
    if config.state_dir is None:
        return MemoryStore(*bound)
    from .sqlite_store import SQLiteStore

    return SQLiteStore.open(Path(config.state_dir), *bound)
