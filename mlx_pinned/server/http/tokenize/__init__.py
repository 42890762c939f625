"""vLLM's ``POST /tokenize`` and ``POST /detokenize``. Event loop only; the
tokenizer runs on the MLX thread."""

from .route import DetokenizeEndpoint as DetokenizeEndpoint
from .route import TokenizeEndpoint as TokenizeEndpoint

__all__ = ["DetokenizeEndpoint", "TokenizeEndpoint"]
