"""OpenAI's Responses API: ``POST /v1/responses``, and ``GET`` and ``DELETE
/v1/responses/{id}`` with its ``input_items``. Event loop only."""

from .route import ResponsesEndpoint as ResponsesEndpoint
from .stored import routes as routes

__all__ = ["ResponsesEndpoint", "routes"]
