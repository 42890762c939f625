"""A served model's slot: its state, its engine while loaded, its counts,
and what the model can take (:class:`Capabilities`).

Event loop only: :class:`~.residency.Residency` (the one model registry)
moves each slot through its states; requests read its engine.
:meth:`Capabilities.of` reads what a model can take from the engine and the
model's format settings, in this one place, once per load (it is kept on
the slot); each API's serving module checks a request against it once,
before the request waits for the model's gate. The engine itself checks
only what needs the exact prompt (its length in tokens, on the MLX thread).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from ..formats import ModelFormats, model_formats

if TYPE_CHECKING:
    from ..events import Engine, Resident
    from ..media import AudioInput
    from .served_models import ServedModel

__all__ = ["Capabilities", "ModelSlot", "SlotChange", "SlotState", "due"]


class SlotState(enum.Enum):
    """Where a model loaded on first use is (see the module's table)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


class SlotChange:
    """One load or unload under way: its waiters wait for ``done``; a load
    that failed leaves its answer in ``error`` and what it raised in
    ``cause``."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: Exception | None = None
        self.cause: BaseException | None = None


@dataclass(eq=False)
class ModelSlot:
    """A served model: its state, engine and counts.

    Attributes:
        name: The served name.
        load: Loads it on the MLX thread and gives its engine.
        measure: Its weight bytes from its checkpoint, on the MLX thread
            (the budget's measure before the first load).
        pinned: Loaded by the lifespan at start-up and never unloaded; else
            loaded on first use.
        idle_timeout: Seconds idle before it is unloaded (None: never).
        state: See :class:`SlotState`.
        engine: Its engine (of its kind) while LOADED.
        capabilities: What its engine can take, read on first use after
            each load (:meth:`~.slots.Capabilities.of`); None once
            it is unloaded.
        holders: Requests holding it now (:meth:`Residency.use`).
        weight_bytes: Its weights' bytes, measured at its last load; None
            before the first.
        idle_since: When the last holder let go (``anyio.current_time()``),
            while LOADED and idle; None otherwise.
        created: Unix time the server was made: the ``created`` in
            ``/v1/models`` of a model loaded on first use, which does not
            move with loads.
        loads, unloads, failures: Loads done, unloads done, loads failed.
    """

    name: str
    load: Callable[[], Awaitable[Resident]]
    measure: Callable[[], Awaitable[int]]
    pinned: bool = False
    idle_timeout: float | None = None
    state: SlotState = SlotState.UNLOADED
    engine: Resident | None = None
    capabilities: Capabilities | None = None
    holders: int = 0
    weight_bytes: int | None = None
    idle_since: float | None = None
    created: float = field(default_factory=time.time)
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    _change: SlotChange | None = field(default=None, repr=False)

    @property
    def idle(self) -> bool:
        """Loaded on first use, loaded now, and held by no request."""
        return self.state is SlotState.LOADED and self.holders == 0 and not self.pinned


def due(slot: ModelSlot) -> float | None:
    """When an idle slot is unloaded (``anyio.current_time()``); None while
    it is not idle, or never is unloaded for it."""
    if not slot.idle or slot.idle_since is None or slot.idle_timeout is None:
        return None
    return slot.idle_since + slot.idle_timeout


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one served model can take, as plain values.

    Attributes:
        context_length: Its context in tokens (None: unknown).
        vocab_size: Valid token ids are below it.
        longest_token_chars: Characters in its longest token, which bounds
            the tokens a text is at least.
        accepts_images: Whether it takes images.
        audio_input: How it takes audio (its rate, its longest file);
            None: it takes no audio.
        chat_template: Its chat template (None: it has none); whether it
            thinks is read from it.
        formats: Its tool-call and reasoning formats (None each: it has
            none), set for it or detected from its template.
    """

    context_length: int | None
    vocab_size: int
    longest_token_chars: int
    accepts_images: bool
    chat_template: str | None
    formats: ModelFormats
    audio_input: AudioInput | None = None

    @classmethod
    def of(cls, engine: Engine, served: ServedModel) -> Capabilities:
        """The capabilities of ``served``, loaded as ``engine``: read once per
        load (its formats detected from its template), then kept on its slot
        until it is unloaded."""
        slot = served.slot
        if slot.engine is engine and slot.capabilities is not None:
            return slot.capabilities
        template = engine.chat_template
        capabilities = cls(
            context_length=engine.context_length,
            vocab_size=engine.vocab_size,
            longest_token_chars=engine.longest_token_chars,
            accepts_images=engine.accepts_images,
            chat_template=template,
            formats=model_formats(
                template,
                tool_call_parser=served.tool_call_parser,
                reasoning_parser=served.reasoning_parser,
            ),
            audio_input=engine.audio_input,
        )
        if slot.engine is engine:  # kept until the residency unloads it
            slot.capabilities = capabilities
        return capabilities
