"""A loaded model of any kind, as the model registry, the metrics and
``/health`` see it: its facts, its weights and its counters. A shared
module (any thread)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineCounters", "Facts", "Resident"]


@dataclass(frozen=True)
class EngineCounters:
    """What the engine reports to metrics and ``/health``; plain numbers.

    Attributes:
        rows: Generations in the batch, joining it or being prefilled.
        ranks: Under tensor parallelism, the rows each rank holds, rank 0
            first (the others as of their last message); empty otherwise.
        kv_bytes_per_token: Over every layer, quantized under ``kv_bits``;
            0 before the first generation.
        decode_steps: Speculative ones included.
        speculative_rows: Rows of the steps that verified drafts, summed.
        disk_cache_bytes: What the two caches' disk tier holds.
        mlx_memory: The whole process's ``(active, cached, peak)`` bytes.
    """

    rows: int
    kv_bytes: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    prompt_cache_reused_tokens: int
    prompt_cache_bytes: int
    ranks: tuple[int, ...] = ()
    kv_bytes_per_token: int = 0
    decode_steps: int = 0
    decoded_tokens: int = 0
    speculative_steps: int = 0
    speculative_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    image_cache_bytes: int = 0
    disk_cache_bytes: int = 0
    mlx_memory: tuple[int, int, int] = (0, 0, 0)


class Facts(Protocol):
    """What a loaded model of any kind is: one frozen value its engine
    builds at load (each kind has its own), read by the doors and the
    registry."""

    def card(self) -> dict[str, Any]:
        """Its entries in its ``/v1/models`` card."""
        ...


@runtime_checkable
class Resident(Protocol):
    """A loaded model of any kind, as the model registry sees it."""

    @property
    def facts(self) -> Facts:
        """What the model is."""
        ...

    @property
    def loaded_at(self) -> float:
        """When the load ended (Unix time)."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (what the memory budget counts)."""
        ...

    def counters(self) -> EngineCounters:
        """A snapshot for metrics; any thread (it may be a step old)."""
        ...
