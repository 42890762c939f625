"""Ollama's API: the chat kind's doors (``/api/chat``, ``/api/generate``),
the embedding kind's (``/api/embed``, ``/api/embeddings``) and the routes
that name no door's work (``/api/tags``, ``/api/show``, ``/api/ps``...),
all answered in Ollama's error shape (docs/ollama.md). Event loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .embed import EmbeddingsEndpoint, EmbedEndpoint
from .models import OllamaModels
from .output import OLLAMA_ERRORS
from .route import ChatEndpoint, GenerateEndpoint

if TYPE_CHECKING:
    from starlette.routing import Route

    from ..door import Wiring

__all__ = [
    "OLLAMA_ERRORS",
    "ChatEndpoint",
    "EmbedEndpoint",
    "EmbeddingsEndpoint",
    "GenerateEndpoint",
    "OllamaModels",
    "routes",
]


def routes(wiring: Wiring) -> list[Route]:
    """The routes no kind's door serves; ``/`` (:meth:`OllamaModels.root`)
    is apart, to go after the playground's page."""
    return OllamaModels(wiring).routes()
