"""The reference OpenAI-compatible server, built on the MLX thread and the
middleware: ``create_app(model)`` is a Starlette app, ``mlx-pinned serve
MODEL`` runs it under uvicorn. Grouped by thread: :mod:`.engine` (the MLX
thread), :mod:`.http` (the event loop), :mod:`.inputs` (worker threads),
:mod:`.kinds` (one package per model kind) and plain shared modules.
"""

from __future__ import annotations

from .app import create_app as create_app
from .config import ImageLimits as ImageLimits
from .config import ServerConfig as ServerConfig

__all__ = ["ImageLimits", "ServerConfig", "create_app"]
