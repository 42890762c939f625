"""The served models as the HTTP side sees them: a name, a gate, a slot.

Event loop only. A server serves one model or several, all on the one MLX
thread. Each model's :attr:`ServedModel.slot` holds its engine while it is
loaded: a model loaded at start-up is loaded by the app's lifespan and
stays; one loaded on first use comes and goes (:mod:`.residency`, the one
place that loads and unloads). Requests are routed by their ``model``; each
model has its own gate, so its batch and its waiting room are its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import APIError

if TYPE_CHECKING:
    from ..events import Engine
    from .gate import BatchGate
    from .slots import ModelSlot

__all__ = ["ServedModel", "ServedModels", "model_not_found"]


@dataclass(frozen=True)
class ServedModel:
    """One model of the server.

    Attributes:
        name: What clients send as ``model``.
        gate: Its own gate: at most ``max_num_seqs`` of its generations at
            once, at most ``max_pending`` waiting.
        slot: Where it is loaded (at start-up, or on first use) and unloaded.
        tool_call_parser: The tool-call format its answers are read in
            (None: detected from its chat template).
        reasoning_parser: The reasoning format its answers are read in
            (None: detected from its chat template).
    """

    name: str
    gate: BatchGate
    slot: ModelSlot
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def engine(self) -> Engine | None:
        """Its engine; None while it is not loaded."""
        return self.slot.engine


def model_not_found(name: str, served: Sequence[str]) -> APIError:
    """The 404 for a model this server does not serve; names those it does."""
    listed = ", ".join(repr(item) for item in served)
    return APIError(
        404,
        f"The model {name!r} does not exist: this server serves {listed}.",
        param="model",
        code="model_not_found",
    )


class ServedModels:
    """The server's models by name, in the order they were given."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("serve at least one model")
        self._by_name = {model.name: model for model in models}
        if len(self._by_name) != len(models):
            raise ValueError("each served model needs its own name")

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def names(self) -> list[str]:
        """Every served name, in order."""
        return list(self._by_name)

    def get(self, name: str) -> ServedModel:
        """The model served as ``name``.

        Raises:
            APIError: 404 ``model_not_found``, naming the served models.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise model_not_found(name, self.names) from None
