"""The prompt cache: the KV of earlier prompts (and answers), reused by a
request whose prompt starts the same way; only the rest is prefilled.
MLX thread only; docs/caching.md says how it is keyed, bounded and tested.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .checkpoints import (
    Layer,
    Marks,
    Part,
    Prefix,
    State,
    StateCheck,
    no_states,
    tree_arrays,
)

if TYPE_CHECKING:
    from PIL import Image

    from .prompt_disk import DiskTier

__all__ = [
    "CacheStatistics",
    "Key",
    "PromptCache",
    "audio_hash",
    "common_prefix",
    "image_hash",
    "is_prefix",
    "prompt_key",
]

Key = np.ndarray[Any, np.dtype[np.int64]]


def image_hash(image: Image.Image) -> int:
    """A content hash of a decoded image: its size, mode and pixels."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{image.size}{image.mode}".encode())
    digest.update(image.tobytes())
    return int.from_bytes(digest.digest(), "little") & (2**62 - 1)


def audio_hash(digest: str) -> int:
    """An audio file's content hash (:attr:`~...media.Audio.digest`, hex) as
    a key value, in the range of :func:`image_hash`'s."""
    return int(digest[:16], 16) & (2**62 - 1)


def prompt_key(
    ids: Sequence[int],
    hashes: Sequence[int],
    media_tokens: frozenset[int],
    videos: Sequence[tuple[int, int]] = (),
    video_token: int | None = None,
    audios: Sequence[int] = (),
    audio_token: int | None = None,
) -> Key | None:
    """The cache key of a prompt: ``ids`` with each run of media tokens
    replaced by its image's content hash (negative, so never a token id), so
    two images of one size never share KV; None when the runs do not match
    the images one to one (not cached then).

    ``videos``: each video's hash and its count of ``video_token`` tokens,
    in prompt order, matched by count (Qwen3-VL splits a video's tokens
    with timestamps). ``audios``: each audio file's hash, one run of
    ``audio_token`` tokens each."""
    key: Key = np.asarray(ids, dtype=np.int64).copy()
    if audios:
        if not _replace_runs(key, key == audio_token, audios):
            return None
        media_tokens = media_tokens - {audio_token}
    if videos:
        spots = np.flatnonzero(key == video_token)
        if len(spots) != sum(count for _, count in videos):
            return None
        first = 0
        for value, count in videos:
            key[spots[first : first + count]] = -value - 1
            first += count
        media_tokens = media_tokens - {video_token}
    media = np.isin(key, np.fromiter(media_tokens, dtype=np.int64))
    return key if _replace_runs(key, media, hashes) else None


def _replace_runs(key: Key, media: np.ndarray[Any, Any], hashes: Sequence[int]) -> bool:
    """Replace each run of ``media`` positions of ``key`` by its hash
    (negative, so never a token id), in order; False (``key`` as it was)
    when the runs do not match the hashes one to one."""
    starts = np.flatnonzero(media & ~np.concatenate(([False], media[:-1])))
    if len(starts) != len(hashes):
        return False
    ends = np.flatnonzero(media & ~np.concatenate((media[1:], [False]))) + 1
    for start, end, value in zip(starts, ends, hashes, strict=True):
        key[start:end] = -value - 1
    return True


@dataclass(frozen=True)
class CacheStatistics:
    """A snapshot of the prompt cache. ``misses``: lookups that found nothing
    to reuse; ``reused_tokens``: prompt tokens not prefilled thanks to it."""

    hits: int
    misses: int
    reused_tokens: int
    entries: int
    bytes: int
    budget: int


@dataclass(eq=False)
class _Entry:
    """A key's KV, and where a model keeps more than KV, its other layers'
    states at some of the key's positions (``marks``): the only positions a
    lookup may resume at then. An entry of a plain KV model has no marks and
    is cut at any token."""

    key: Key
    kv: list[tuple[Part, Part] | None]  # (1, H, T, D) keys and values; None: a state
    marks: Marks  # a position's states (None: a KV layer)
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = sum(_nbytes(k) + _nbytes(v) for k, v in filter(None, self.kv))
        states = (s for layers in self.marks.values() for s in layers)
        self.nbytes += sum(s.nbytes for s in states if s is not None)

    def usable(self, common: int) -> int:
        """The most of its first ``common`` tokens a lookup can resume at."""
        if all(layer is not None for layer in self.kv):
            return common
        return max((at for at in self.marks if at <= common), default=0)

    def prefix(self, length: int) -> Prefix:
        layers: list[Layer] = []
        for i, kv in enumerate(self.kv):
            if kv is None:
                state = self.marks[length][i]
                assert state is not None
                layers.append(state)
            else:
                layers.append((_cut(kv[0], length), _cut(kv[1], length)))
        return Prefix(length, layers)


class PromptCache:
    """Prompt KV by key, least recently used out first, within ``budget`` bytes
    (0: off). ``disk``: where entries are also written and looked up."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.lent = 0  # bytes of its budget lent to the requests' charges
        self.disk: DiskTier | None = None
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.reused_tokens = 0
        #: Raises ValueError for a state from disk (of layer ``index``, at
        #: ``position``) the model's layer cannot take; set by its batch.
        self.check: StateCheck = no_states

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def limit(self) -> int:
        """The bytes it may hold now: its budget, less what it lent."""
        return self.budget - self.lent

    def lend(self, nbytes: int) -> None:
        """Hold ``nbytes`` less than the budget (at most all of it), the
        oldest entries past that dropped now."""
        self.lent = min(max(nbytes, 0), self.budget)
        while self._bytes > self.limit:
            self._drop(next(iter(self._entries)))

    def attach(self, disk: DiskTier) -> None:
        """Write entries to ``disk`` too, and look them up there (not while off)."""
        if self.enabled and disk.enabled:
            self.disk = disk

    def statistics(self) -> CacheStatistics:
        """A snapshot, perhaps a step old; any thread."""
        return CacheStatistics(
            self.hits,
            self.misses,
            self.reused_tokens,
            len(self._entries),
            self._bytes,
            self.budget,
        )

    def longest(self, key: Key, limit: int) -> int:
        """How long a prefix of ``key`` a lookup would reuse (at most ``limit``
        tokens), counted nowhere and loaded from nowhere."""
        length = self._best(key, limit)[1]
        if self.disk is not None:
            length = max(length, self.disk.best(key, limit)[1])
        return length

    def _best(self, key: Key, limit: int) -> tuple[_Entry | None, int]:
        best: _Entry | None = None
        length = 0
        for entry in self._entries.values():
            usable = entry.usable(common_prefix(entry.key, key, limit, length))
            if usable > length:
                best, length = entry, usable
        return best, length

    def lookup(self, key: Key, limit: int) -> Prefix:
        """The longest reusable prefix of ``key``, at most ``limit`` tokens
        (length 0: none)."""
        best, length = self._best(key, limit)
        if self.disk is not None:
            name, usable = self.disk.best(key, limit)
            loaded = None
            if name is not None and usable > length:
                loaded = self.disk.load(name, self.check)
            if loaded is not None:
                best, length = self._hold(_Entry(*loaded)), usable
        if best is None or length == 0:
            self.misses += 1
            return Prefix(0, [])
        if id(best) in self._entries:  # not one from disk past the budget
            self._entries.move_to_end(id(best))
        self.hits += 1
        self.reused_tokens += length
        return best.prefix(length)

    def store(self, key: Key, layers: Sequence[Layer], *, disk: bool = True) -> None:
        """Hold each layer of ``key``'s tokens (keys and values, or a state at
        its end); entries whose keys are a prefix of ``key`` go (this one
        serves their lookups: their states are kept in it). ``disk``: written
        to the disk tier too."""
        if not self.enabled or not len(key):
            return
        tokens = len(key)
        kv = [
            None
            if isinstance(layer, State)
            else (_cut(layer[0], tokens, True), _cut(layer[1], tokens, True))
            for layer in layers
        ]
        states = [layer if isinstance(layer, State) else None for layer in layers]
        marks = {tokens: states} if any(states) else {}
        mx.eval(kv, [tree_arrays(state.payload) for state in states if state])
        entry = _Entry(key.copy(), kv, marks)
        if entry.nbytes > self.limit:
            return
        self._hold(entry)
        if disk and self.disk is not None:
            self.disk.save(entry.key, entry.kv, entry.marks)

    def _hold(self, entry: _Entry) -> _Entry:
        """Keep the evaluated ``entry``; its prefixes go (their states kept in
        it), and the oldest past the budget."""
        if entry.nbytes > self.limit:  # one from disk: served, not held
            return entry
        for entry_id, other in list(self._entries.items()):
            if is_prefix(other.key, entry.key):
                self._drop(entry_id)
                if entry.marks:
                    entry.marks = {**other.marks, **entry.marks}
        entry.__post_init__()  # its bytes, with the states it took
        self._entries[id(entry)] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.limit:
            self._drop(next(iter(self._entries)))
        return entry

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._bytes -= entry.nbytes


def common_prefix(stored: Key, key: Key, limit: int, beat: int = 0) -> int:
    """How many tokens ``stored`` and ``key`` share from the start, at most
    ``limit``; 0 where that cannot be more than ``beat`` (not compared)."""
    n = min(len(stored), len(key), limit)
    if n <= beat:
        return 0
    differs = np.flatnonzero(stored[:n] != key[:n])
    return int(differs[0]) if len(differs) else n


def is_prefix(short: Key, key: Key) -> bool:
    return len(short) <= len(key) and np.array_equal(short, key[: len(short)])


def _cut(part: Part, tokens: int, contiguous: bool = False) -> Part:
    """``part``'s first ``tokens`` tokens (each quantized piece alike)."""
    if isinstance(part, tuple):
        return tuple(_cut(piece, tokens, contiguous) for piece in part)
    cut = part[:, :, :tokens]
    return mx.contiguous(cut) if contiguous else cut


def _nbytes(part: Part) -> int:
    if isinstance(part, tuple):
        return sum(int(piece.nbytes) for piece in part)
    return int(part.nbytes)
