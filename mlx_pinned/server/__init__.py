"""The reference OpenAI-compatible vision server, built on the MLX thread,
the decorator and the middleware.

``create_app(model)`` returns a Starlette app that serves ``model`` on one MLX
thread; ``mlx-pinned serve MODEL`` (or ``python -m mlx_pinned.server``) runs
it under uvicorn. The package is grouped by the thread its code runs on:
:mod:`.engine` (the MLX thread), :mod:`.http` (the event loop),
:mod:`.inputs` (worker threads), and plain shared modules (:mod:`.config`,
:mod:`.events`, :mod:`.failures`, :mod:`.formats`, :mod:`.grammars`,
:mod:`.limits`, :mod:`.media`).
"""

from __future__ import annotations

from .app import create_app as create_app
from .config import ImageLimits as ImageLimits
from .config import ServerConfig as ServerConfig

__all__ = ["ImageLimits", "ServerConfig", "create_app"]
