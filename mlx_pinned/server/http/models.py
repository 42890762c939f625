"""The served models as the HTTP side sees them: a name, a gate, an engine.

Event loop only. A server serves one model or several, all on the one MLX
thread. Each is loaded by its own start-up job of the middleware, whose
result (its engine) is in the lifespan state under the model's
:attr:`ServedModel.state_key`, or, with ``load_on_first_use``, by its first
request: then its :attr:`ServedModel.slot` holds its engine while it is
loaded (:mod:`.residency`). Requests are routed by their ``model``; each
model has its own gate, so its batch and its waiting room are its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import APIError

if TYPE_CHECKING:
    from ..events import Engine
    from .gate import BatchGate
    from .residency import ModelSlot

__all__ = ["ServedModel", "ServedModels", "model_not_found"]


@dataclass(frozen=True)
class ServedModel:
    """One model of the server.

    Attributes:
        name: What clients send as ``model``.
        state_key: The lifespan-state key of its engine (the name of the
            start-up job that loads it).
        gate: Its own gate: at most ``max_num_seqs`` of its generations at
            once, at most ``max_pending`` waiting.
        slot: Where it is loaded on first use and unloaded (None: it is
            loaded at start-up and stays loaded).
    """

    name: str
    state_key: str
    gate: BatchGate
    slot: ModelSlot | None = None

    def engine(self, state: Mapping[str, Any]) -> Engine | None:
        """Its engine: in its slot, or in the lifespan ``state``; None while
        it is not loaded."""
        if self.slot is not None:
            return self.slot.engine
        engine: Engine | None = state.get(self.state_key)
        return engine


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

    def loaded(self, state: Mapping[str, Any]) -> bool:
        """Whether every model loaded at start-up has its engine in the
        lifespan ``state`` (those loaded on first use are not waited for)."""
        return all(model.state_key in state for model in self if model.slot is None)
