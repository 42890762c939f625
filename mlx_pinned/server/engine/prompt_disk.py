"""The caches' disk tier (docs/caching.md): prompt cache entries (``.kv``)
and images' outputs (``.img``) as files under ``state_dir``, within one
byte budget. Lookups and loads run on the MLX thread, writes on a thread
of the tier's own. A file that fails a check is removed, never served; a
full disk pauses the writes until it has room again, another failed write
turns the tier off, and the caches go on in memory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import hashlib
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from . import disk_format
from .checkpoints import Marks, StateCheck, encode, no_states
from .image_cache import Output as ImageOutput
from .prompt_cache import common_prefix, is_prefix

#: A prompt cache entry as the tier hands it over: its key, its KV layers
#: (None: a layer kept as a state) and its states at each position.
Entry = tuple[Any, list[tuple[Any, Any] | None], Marks]

__all__ = ["DiskTier"]

_T = TypeVar("_T")

logger = logging.getLogger("mlx_pinned.server")

SUFFIX = ".kv"
IMAGE_SUFFIX = ".img"


@dataclass(frozen=True, slots=True)
class _File:
    key: np.ndarray[Any, np.dtype[np.int64]] | None  # None: an image's
    nbytes: int
    marks: tuple[int, ...] = ()  # where its states are (none: cut anywhere)


@dataclass(frozen=True, slots=True)
class _Write:
    name: str
    key: np.ndarray[Any, np.dtype[np.int64]] | None
    meta: dict[str, Any]  # what the kind needs in the header
    arrays: list[Any]  # evaluated mx.arrays (their buffers are written)


class DiskTier:
    """Prompt cache entries and images' outputs in ``folder`` (one per model),
    least recently used out first past ``budget`` bytes."""

    def __init__(self, folder: Path, budget: int, fingerprint: str) -> None:
        self.folder = folder
        self.budget = budget
        self.fingerprint = fingerprint
        self.enabled = budget > 0
        self._files: OrderedDict[str, _File] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._lock = threading.Lock()  # the MLX thread and the writer
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._full = False  # a write found the disk full (the writer's)
        if self.enabled:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._off(f"cannot make {folder} ({exc.strerror or exc})")
            else:
                if os.access(folder, os.W_OK):
                    self._scan()
                else:
                    self._off(f"{folder} is read-only")

    # On the MLX thread.

    @property
    def nbytes(self) -> int:
        """Bytes of the files it holds; any thread."""
        return self._bytes

    def best(self, key: Any, limit: int) -> tuple[str | None, int]:
        """The prompt cache file that resumes the longest prefix of ``key`` (at
        most ``limit`` tokens), and its length (None, 0: none)."""
        found: str | None = None
        length = 0
        with self._lock:
            files = list(self._files.items())
        for name, file in files:
            if file.key is None:
                continue
            common = common_prefix(file.key, key, limit, length)
            if file.marks:
                common = max((at for at in file.marks if at <= common), default=0)
            if common > length:
                found, length = name, common
        return found, length

    def load(self, name: str, check: StateCheck = no_states) -> Entry | None:
        """A prompt cache file's key, KV and states, checked (its key must be the
        one :meth:`best` found it by; ``check`` raises ValueError for a state
        the model's layer cannot take); None where it is gone or fails a check."""
        with self._lock:
            file = self._files.get(name)
        if file is None or file.key is None:
            return None
        build = functools.partial(_entry, key=file.key, check=check)
        return self._load(name, build)

    def save(
        self,
        key: Any,
        kv: Sequence[tuple[Any, Any] | None],
        marks: Marks | None = None,
    ) -> None:
        """Write an entry on the writer thread; entries whose keys are a prefix of
        ``key`` go (it serves their lookups)."""
        key = np.asarray(key, dtype=np.int64).copy()
        parts = [part for pair in kv if pair is not None for part in pair]
        arrays = [piece for part in parts for piece in _pieces(part)]
        layers = [
            None if pair is None else [len(_pieces(p)) for p in pair] for pair in kv
        ]
        states = [
            [at, [None if s is None else encode(s.payload, arrays) for s in layer]]
            for at, layer in sorted((marks or {}).items())
        ]
        meta = {"key": key.tobytes().hex(), "layers": layers, "marks": states}
        self._put(_Write(_name(key), key, meta, arrays))

    def load_image(self, digest: bytes, rows: int) -> ImageOutput | None:
        """An image's outputs by its content hash, checked (``rows``: the feature
        rows it must have); None where it is not here or fails a check."""
        name = _image_name(digest)
        with self._lock:
            if name not in self._files:
                return None
        return self._load(name, functools.partial(_image, digest=digest, rows=rows))

    def save_image(self, digest: bytes, output: ImageOutput) -> None:
        """Write an image's outputs on the writer thread (made contiguous: the
        tower's are cut from one output)."""
        if not self.enabled:
            return
        features, deep = output
        arrays = [mx.contiguous(array) for array in (features, *(deep or ()))]
        mx.eval(arrays)
        meta = {"key": digest.hex(), "deep": None if deep is None else len(deep)}
        self._put(_Write(_image_name(digest), None, meta, arrays))

    def _put(self, item: _Write) -> None:
        if not self.enabled:
            return
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_all, name="mlx-pinned-disk-tier", daemon=True
            )
            self._writer.start()
            # A stop writes what was handed over (atexit runs before daemon
            # threads are stopped, after the server's own shutdown).
            atexit.register(self.close)
        self._writes.put(item)

    def _load(
        self, name: str, build: Callable[[dict[str, Any], list[mx.array]], _T]
    ) -> _T | None:
        """What ``build`` makes of a file's header and arrays (it raises
        ValueError for what its kind cannot take); None where a check fails."""
        path = self.folder / name
        try:
            header, payload = disk_format.read(path, self.fingerprint)
            built = build(header, disk_format.arrays(header, payload))
        except Exception as exc:  # whatever a file holds, no request sees it
            self._damaged(path, exc)
            return None
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(path)  # a restart orders the files by their last use
        return built

    def flush(self) -> None:
        """Wait until every entry handed over is written (or refused)."""
        self._writes.join()

    def close(self) -> None:
        """Write what is handed over, then stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
            atexit.unregister(self.close)

    # On the writer thread.

    def _write_all(self) -> None:
        while (item := self._writes.get()) is not None:
            self._write_one(item)
        self._writes.task_done()

    def _write_one(self, item: _Write) -> None:
        try:
            if self.enabled:
                self._write(item)
        except Exception as exc:  # a bug: the cache goes on in memory
            logger.exception("disk tier file not written")
            self._off(f"a write failed ({exc!r})")
        finally:
            self._writes.task_done()

    def _write(self, item: _Write) -> None:
        payload_size = sum(int(array.nbytes) for array in item.arrays)
        with self._lock:
            if payload_size > self.budget or item.name in self._files:
                return
        head = disk_format.header(self.fingerprint, item.arrays, item.meta)
        nbytes = len(head) + payload_size
        if nbytes > self.budget or not self._room_for(nbytes):
            return
        temporary = self.folder / f".{item.name}.{os.getpid()}.tmp"
        try:
            with temporary.open("wb") as out:
                out.write(head)
                for array in item.arrays:
                    out.write(memoryview(array))
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.folder / item.name)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a read-only folder refuses it too
                temporary.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._full = True
                logger.warning(
                    "the caches' disk tier is full (%s): no writes until the "
                    "disk has room, loads go on",
                    exc,
                )
            else:
                self._off(f"cannot write in {self.folder} ({exc.strerror or exc})")
            return
        key = item.key
        with self._lock:
            self._files[item.name] = _File(key, nbytes, _marks(item.meta))
            self._bytes += nbytes
            gone: list[str] = []
            if key is not None:  # the prefixes of its key: it serves them
                gone = [
                    other
                    for other, file in self._files.items()
                    if file.key is not None and other != item.name
                    if is_prefix(file.key, key)
                ]
            for other in gone:
                self._bytes -= self._files.pop(other).nbytes
            while self._bytes > self.budget:  # the least recently used go
                other, file = self._files.popitem(last=False)
                self._bytes -= file.nbytes
                gone.append(other)
        for other in gone:
            (self.folder / other).unlink(missing_ok=True)

    def _room_for(self, nbytes: int) -> bool:
        """Whether a write may go ahead: always, unless the disk was full;
        then once it has room for ``nbytes`` again."""
        if not self._full:
            return True
        try:
            if shutil.disk_usage(self.folder).free < nbytes:
                return False
        except OSError:
            return False
        self._full = False
        logger.info("the caches' disk tier has room again: writes resume")
        return True

    # Either thread.

    def _scan(self) -> None:
        """The files already there (a restart's): their headers only, the rest is
        checked as each is loaded."""
        paths = [*self.folder.glob(f"*{SUFFIX}"), *self.folder.glob(f"*{IMAGE_SUFFIX}")]
        for path in sorted(paths, key=_mtime):
            try:
                header, _ = disk_format.read(path, self.fingerprint, header_only=True)
                key = _named_key(header, path.name)
                size = path.stat().st_size
            except Exception as exc:  # whatever a file holds, the server starts
                self._damaged(path, exc)
                continue
            self._files[path.name] = _File(key, size, _marks(header))
            self._bytes += size
        for stale in self.folder.glob(".*.tmp"):  # a write cut short
            stale.unlink(missing_ok=True)

    def _damaged(self, path: Path, exc: Exception) -> None:
        """Skip and remove a file that failed a check, with one warning line."""
        why = str(exc) if isinstance(exc, (OSError, ValueError)) else repr(exc)
        logger.warning("disk tier file %s skipped and removed: %s", path, why)
        with self._lock:
            file = self._files.pop(path.name, None)
            if file is not None:
                self._bytes -= file.nbytes
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)

    def _off(self, why: str) -> None:
        logger.warning(
            "the caches' disk tier off, memory only: %s; make the folder "
            "writable and restart, or set --prompt-cache-disk-bytes 0",
            why,
        )
        self.enabled = False


def _name(key: Any) -> str:
    digest = hashlib.blake2b(np.asarray(key, dtype=np.int64).tobytes(), digest_size=16)
    return digest.hexdigest() + SUFFIX


def _named_key(
    header: dict[str, Any], name: str
) -> np.ndarray[Any, np.dtype[np.int64]] | None:
    """The prompt key a file's header holds (None: an image's).

    Raises:
        ValueError: It is not the key the file's ``name`` is made from.
    """
    text = header.get("key")
    if not isinstance(text, str):
        raise ValueError("its header has no key")
    if name.endswith(IMAGE_SUFFIX):
        if _image_name(bytes.fromhex(text)) != name:
            raise ValueError("it holds another image's outputs than its name says")
        return None
    key = np.frombuffer(bytes.fromhex(text), dtype=np.int64)
    if not len(key) or _name(key) != name:
        raise ValueError("it holds another prompt's entry than its name says")
    return key


def _image_name(digest: bytes) -> str:
    return digest.hex() + IMAGE_SUFFIX


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _pieces(part: Any) -> tuple[Any, ...]:
    return part if isinstance(part, tuple) else (part,)


def _marks(header: dict[str, Any]) -> tuple[int, ...]:
    """Where a prompt cache file's states are, as its header says (checked
    whole when it is loaded)."""
    marks = header.get("marks")
    if not isinstance(marks, list):
        return ()
    return tuple(m[0] for m in marks if isinstance(m, list) and m and type(m[0]) is int)


def _entry(
    header: dict[str, Any],
    arrays: list[mx.array],
    *,
    key: Any,
    check: StateCheck,
) -> Entry:
    """A prompt cache entry, looked up by ``key`` (:func:`.disk_format.layers`
    says what its layers and states must be)."""
    found = _named_key(header, _name(key))
    if found is None or not np.array_equal(found, key):
        raise ValueError("it holds another prompt's entry than its name says")
    kv, marks = disk_format.layers(header, arrays, len(key), check)
    return key, kv, marks


def _image(
    header: dict[str, Any], arrays: list[mx.array], *, digest: bytes, rows: int
) -> ImageOutput:
    _named_key(header, _image_name(digest))
    deep = header.get("deep")
    if deep is not None and (type(deep) is not int or deep < 0):
        raise ValueError("its deepstack count is not one")
    if len(arrays) != 1 + (deep or 0) or any(
        a.ndim == 0 or a.shape[0] != rows for a in arrays
    ):
        raise ValueError("its arrays do not match the image")
    return arrays[0], None if deep is None else arrays[1:]
