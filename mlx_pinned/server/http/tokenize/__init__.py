"""The tokenizer slice of the HTTP side: vLLM's ``POST /tokenize`` and
``POST /detokenize``.

Event loop only, as all of :mod:`..http`. The protocol (:mod:`.protocol`:
vLLM's request shapes, which turn into the shared
:class:`~...events.GenerationParams` a generation of the same prompt would
get) and the routes (:mod:`.route`); the tokenizer itself runs where the
engine keeps it, on the MLX thread (:meth:`~...events.Engine.tokenize`).
"""

from .route import DetokenizeEndpoint as DetokenizeEndpoint
from .route import TokenizeEndpoint as TokenizeEndpoint

__all__ = ["DetokenizeEndpoint", "TokenizeEndpoint"]
