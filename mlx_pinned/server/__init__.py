"""The reference OpenAI-compatible vision server (layer 4).

``create_app(model)`` returns a Starlette app that serves ``model`` on one MLX
thread; ``mlx-pinned serve MODEL`` (or ``python -m mlx_pinned.server``) runs
it under uvicorn.
"""

from __future__ import annotations

from .app import ServerConfig as ServerConfig
from .app import create_app as create_app
from .images import ImageLimits as ImageLimits

__all__ = ["ImageLimits", "ServerConfig", "create_app"]
