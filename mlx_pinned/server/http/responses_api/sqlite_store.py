"""The Responses store in a SQLite file under ``state_dir``: a restart, or
a crash, keeps every response it acknowledged (docs/responses.md).

Called on the event loop; every query runs on a worker thread, one at a
time. The database is held exclusively: a second server on the same
``state_dir`` is refused at start."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ...config import SettingError
from .store import (
    DamagedResponseError,
    Entry,
    Ledger,
    ResponseStore,
    StoredResponse,
    encoded,
)

__all__ = ["FILE_NAME", "FORMAT", "SQLiteStore"]

logger = logging.getLogger("mlx_pinned.server")

#: The database's name in ``state_dir``.
FILE_NAME = "responses.sqlite3"
#: The format this server writes and reads (``PRAGMA user_version``).
FORMAT = 1
#: Seconds the start waits for a database another process holds (one
#: that is stopping) before it is refused.
BUSY_SECONDS = 2.0
#: Marks the file as this store's (``PRAGMA application_id``: "MLXR").
APPLICATION_ID = 0x4D4C5852

SCHEMA = """
CREATE TABLE responses (
    seq INTEGER PRIMARY KEY,  -- the order they were stored in: oldest out first
    id TEXT NOT NULL UNIQUE,
    size INTEGER NOT NULL,
    image_count INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    images TEXT NOT NULL
)
"""


class SQLiteStore(ResponseStore):
    """Responses in ``connection``'s database; made by :meth:`open`."""

    def __init__(
        self, connection: sqlite3.Connection, ledger: Ledger, path: Path
    ) -> None:
        # Only the query thread changes the ledger (one at a time); the loop
        # reads it.
        super().__init__(ledger)
        self.path = path
        self._connection: sqlite3.Connection | None = connection
        self._limiter = anyio.CapacityLimiter(1)

    @classmethod
    def open(cls, folder: Path, max_count: int, max_bytes: int) -> SQLiteStore:
        """Open (or make) the store in ``folder``: checked whole, read back,
        and trimmed to the bound. Blocks: called once, at start-up.

        Raises:
            SettingError: ``state_dir`` cannot hold it.
        """
        path = folder / FILE_NAME
        try:
            folder.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(
                path,
                isolation_level=None,
                check_same_thread=False,
                timeout=BUSY_SECONDS,
            )
        except (OSError, sqlite3.Error) as exc:
            raise _refused(folder, f"cannot write there ({_reason(exc)})") from None
        try:
            ledger = _prepare(connection, Ledger(max_count, max_bytes))
        except _BadFile as exc:
            connection.close()
            raise _refused(folder, f"{FILE_NAME} {exc}") from None
        except sqlite3.Error as exc:
            connection.close()
            raise _refused(folder, _unusable(exc)) from None
        return cls(connection, ledger, path)

    async def get(self, response_id: str) -> StoredResponse | None:
        if response_id not in self._ledger.entries:
            return None  # no query for an id never stored
        stored: StoredResponse | None = await self._run(self._read, response_id)
        return stored

    async def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: tuple[dict[str, Any], ...],
        images: tuple[str, ...],
    ) -> bool:
        kept: bool = await self._run(
            self._write, response, input_items, messages, images
        )
        return kept

    async def delete(self, response_id: str) -> bool:
        if response_id not in self._ledger.entries:
            return False
        gone: bool = await self._run(self._drop, response_id)
        return gone

    async def aclose(self) -> None:
        await self._run(self._close)

    async def _run(self, job: Any, *args: Any) -> Any:
        # Not abandoned on cancel: a write that began ends, ledger included.
        return await anyio.to_thread.run_sync(job, *args, limiter=self._limiter)

    # On the query thread, one at a time.

    def _read(self, response_id: str) -> StoredResponse | None:
        if self._connection is None:
            return None
        try:
            row = self._connection.execute(
                "SELECT response, input_items, messages, images, size "
                "FROM responses WHERE id = ?",
                (response_id,),
            ).fetchone()
            if row is None:
                return None
            response, input_items, messages, images, size = row
            parts = [json.loads(part) for part in (response, input_items, messages)]
            parts.append(json.loads(images))
        except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
            raise self._damaged(response_id, exc) from None
        if [type(part) for part in parts] != [dict, list, list, list]:
            raise self._damaged(response_id, "its parts are of the wrong types")
        response, input_items, messages, images = parts
        return StoredResponse(
            response, input_items, tuple(messages), tuple(images), size
        )

    def _damaged(self, response_id: str, why: object) -> DamagedResponseError:
        logger.warning(
            "response %s in %s cannot be read: %s", response_id, self.path, why
        )
        return DamagedResponseError(response_id, str(why))

    def _write(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: tuple[dict[str, Any], ...],
        images: tuple[str, ...],
    ) -> bool:
        parts = encoded(response, input_items, messages, images)
        size = sum(map(len, parts))
        response_id = response["id"]
        if self._connection is None or not self._ledger.fits(size):
            return False
        evicted = self._ledger.evicted_by(response_id, size)
        try:
            with _transaction(self._connection) as cursor:
                cursor.executemany(
                    "DELETE FROM responses WHERE id = ?",
                    [(old_id,) for old_id in (*evicted, response_id)],
                )
                cursor.execute(
                    "INSERT INTO responses (id, size, image_count, response, "
                    "input_items, messages, images) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (response_id, size, len(images), *parts),
                )
        except sqlite3.Error as exc:
            logger.warning(
                "response %s not stored in %s: %s", response_id, self.path, exc
            )
            return False
        for old_id in evicted:
            self._ledger.remove(old_id)
        self._ledger.add(response_id, Entry(size, len(images)))
        return True

    def _drop(self, response_id: str) -> bool:
        if self._connection is None:
            return False
        try:
            with _transaction(self._connection) as cursor:
                cursor.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        except sqlite3.Error as exc:
            logger.warning(
                "response %s not deleted from %s: %s", response_id, self.path, exc
            )
            return False
        return self._ledger.remove(response_id)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class _BadFile(Exception):
    """The file is corrupt, another program's, or of another format."""


@contextlib.contextmanager
def _transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection.cursor()
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _prepare(connection: sqlite3.Connection, ledger: Ledger) -> Ledger:
    """Check the database (made, if new; nothing is migrated) and read it
    back: ``ledger`` filled, and trimmed to its bound."""
    # Held by this process until it closes the file: a second server on the
    # same folder fails here, not later with each other's rows.
    connection.execute("PRAGMA locking_mode = EXCLUSIVE")
    (mode,) = connection.execute("PRAGMA journal_mode = WAL").fetchone()
    if mode != "wal":
        raise sqlite3.OperationalError(f"cannot use WAL mode (it is {mode})")
    # A commit is in the WAL (the OS's) when it returns: a crash keeps it.
    connection.execute("PRAGMA synchronous = NORMAL")
    (check,) = connection.execute("PRAGMA quick_check").fetchone()
    if check != "ok":
        raise _BadFile(f"is corrupt ({check}): move it away to start empty")
    with _transaction(connection) as cursor:
        (owner,) = cursor.execute("PRAGMA application_id").fetchone()
        (version,) = cursor.execute("PRAGMA user_version").fetchone()
        tables = cursor.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'"
        ).fetchone()[0]
        if owner == 0 and version == 0 and tables == 0:  # a new file
            cursor.execute(SCHEMA)
            cursor.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            cursor.execute(f"PRAGMA user_version = {FORMAT}")
        elif owner != APPLICATION_ID:
            raise _BadFile(
                "is not a Responses store: move it away, or give another folder"
            )
        elif version != FORMAT:
            raise _BadFile(
                f"is of format {version}, this server reads {FORMAT}: move it "
                "away, or give another folder"
            )
        rows = cursor.execute(
            "SELECT id, size, image_count FROM responses ORDER BY seq"
        )
        for response_id, size, image_count in rows:
            ledger.add(response_id, Entry(size, image_count))
        over = ledger.over()
        cursor.executemany(
            "DELETE FROM responses WHERE id = ?", [(old_id,) for old_id in over]
        )
    for old_id in over:
        ledger.remove(old_id)
    return ledger


def _refused(folder: Path, why: str) -> SettingError:
    return SettingError("state_dir", f"state_dir {str(folder)!r}: {why}")


def _unusable(exc: sqlite3.Error) -> str:
    if "locked" in str(exc):
        return f"{FILE_NAME} is in use by another process: give each server its own"
    if isinstance(exc, sqlite3.OperationalError):
        return f"cannot write {FILE_NAME} ({exc})"
    return f"{FILE_NAME} cannot be read ({exc}): move it away to start empty"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
