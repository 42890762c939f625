"""The chat engine, continuous batching of one model (docs/engine.md), and
the loop the encoder kinds share (:mod:`.passes`). All of it runs on the
MLX thread but :mod:`.driver`, its event-loop side. No HTTP here: it takes
and answers :mod:`..events` values.
"""

from __future__ import annotations

from .batch import BatchEngine as BatchEngine
from .batch import BatchStatistics as BatchStatistics
from .drafting import DraftSettings as DraftSettings
from .model import LoadedModel as LoadedModel
from .model import load as load

__all__ = ["BatchEngine", "BatchStatistics", "DraftSettings", "LoadedModel", "load"]
