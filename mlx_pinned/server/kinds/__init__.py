"""The kinds of model a server serves: one registry of :class:`Kind` entries.

Any thread: an entry imports its engine (MLX) and doors (Starlette) only
when the server is built. The rest of the server loops over :data:`KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from mlx_pinned import MLXThread


__all__ = ["COMMON_SETTINGS", "KINDS", "Kind", "kind_named", "register"]

#: The per-model settings every kind honours: its gate and its slot.
COMMON_SETTINGS = frozenset(
    {
        "model_kind",
        "max_num_seqs",
        "max_pending",
        "load_on_first_use",
        "idle_unload_timeout",
        "pinned",
    }
)


@dataclass(frozen=True)
class Kind:
    """One kind of model, everything about it the rest of the server reads.

    Attributes:
        what: The kind in words, for errors (``a speech model``).
        paths: Its doors' paths; a request for a model of this kind at
            another door is told to use the first.
        protocol: The ``runtime_checkable`` engine protocol its doors use.
        load: Makes its engine from one model's settings; MLX thread.
        routes: Its doors' routes, given the server's ``Wiring``.
        settings: The per-model settings it honours beyond
            :data:`COMMON_SETTINGS`; the server's others do not apply to it.
        demo: Writes (or finds) its tiny demo model, offline; its path.
    """

    name: str
    what: str
    paths: tuple[str, ...]
    protocol: type[Any]
    load: Callable[[Any, MLXThread], Any] | None = None
    routes: Callable[[Any], Sequence[Any]] | None = None
    settings: frozenset[str] = field(default_factory=frozenset)
    demo: Callable[[], Path] | None = None

    def honours(self, setting: str) -> bool:
        return setting in COMMON_SETTINGS or setting in self.settings


#: Every kind served, by name, in the order ``/v1/models`` and the docs list them.
KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add ``kind`` to the registry (its name must be new); ``kind``."""
    if kind.name in KINDS:
        raise ValueError(f"a kind named {kind.name!r} is registered already")
    KINDS[kind.name] = kind
    return kind


def kind_named(name: str) -> Kind:
    """The kind called ``name``; a ValueError that lists the kinds if none is."""
    try:
        return KINDS[name]
    except KeyError:
        listed = ", ".join(KINDS)
        raise ValueError(f"model_kind must be one of {listed}, not {name!r}") from None


def _register_built_in() -> None:
    from . import chat, embedding, rerank, speech, transcription

    for module in (chat, embedding, rerank, transcription, speech):
        register(module.KIND)


_register_built_in()
