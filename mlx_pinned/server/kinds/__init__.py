"""The kinds of model a server serves: one registry of :class:`Kind` entries.

A shared module (any thread): an entry names its kind, its doors' paths and
the engine protocol its doors type against; it imports its engine (MLX) and
its doors (Starlette) only when the server is built, so reading the
registry costs neither. The rest of the server loops over :data:`KINDS`;
nothing else names a kind by hand. A sixth kind is a package and a
:func:`register` call.
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
        name: What ``model_kind`` says (``chat``, ``speech``).
        what: The kind in words, for errors (``a speech model``).
        paths: Its doors' paths; a model of this kind sent elsewhere is told
            to send it to the first.
        protocol: The engine protocol its doors type against (a
            ``runtime_checkable`` Protocol of its values).
        load: Loads a model of this kind from one model's settings and makes
            its engine; runs on the MLX thread.
        routes: Its doors' routes, each door made with the server's wiring
            (:class:`~..http.door.Wiring`).
        settings: The per-model settings it honours beyond every kind's
            (:data:`COMMON_SETTINGS`): a model of this kind may set only
            those, and the server's others do not apply to it.
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
        """Whether a model of this kind honours the per-model ``setting``."""
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
    """The kind called ``name``.

    Raises:
        ValueError: No kind is called so (the message lists them).
    """
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
