"""The embeddings slice of the HTTP side: OpenAI's ``POST /v1/embeddings``.

Event loop only, as all of :mod:`..http`. The protocol (:mod:`.protocol`:
OpenAI's request, which turns into the shared
:class:`~...encoders.EmbeddingParams`), its one check against the model
(:mod:`.serving`) and the route (:mod:`.route`); the model runs where its
engine keeps it, on the MLX thread (:class:`~...encoders.EmbeddingEngine`).
"""

from .route import EmbeddingsEndpoint as EmbeddingsEndpoint

__all__ = ["EmbeddingsEndpoint"]
