"""The engine: everything here runs on the MLX thread (mlx, mlx-vlm), but
:mod:`.driver`, the loop's event-loop side (docs/engine.md).

It never imports Starlette, pydantic or anything HTTP: it takes
:class:`~..events.GenerationParams` and decoded images, and answers with
:mod:`..events`. :class:`BatchEngine` is the one engine (continuous
batching; ``max_num_seqs`` 1 is a batch of one).
"""

from __future__ import annotations

from .batch import BatchEngine as BatchEngine
from .batch import BatchStatistics as BatchStatistics
from .drafting import DraftSettings as DraftSettings
from .model import LoadedModel as LoadedModel
from .model import load as load

__all__ = ["BatchEngine", "BatchStatistics", "DraftSettings", "LoadedModel", "load"]
