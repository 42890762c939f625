"""The Responses slice of the HTTP side: ``POST /v1/responses``, and ``GET``
and ``DELETE /v1/responses/{id}`` with its ``input_items``.

Event loop only, as all of :mod:`..http`. The same three steps as every
slice: the protocol (:mod:`.protocol`, with :mod:`.items`: OpenAI's pydantic
models, which turn themselves into the shared
:class:`~...events.GenerationParams`); the serving (:mod:`.serving`: the one
place a request is checked against the model's
:class:`~...events.ChatFacts` and the stored responses); the route
(:mod:`.route`, written through :mod:`.objects`). Stored responses live in
:mod:`.store` (in memory, or in SQLite under ``state_dir``:
:mod:`.sqlite_store`), their routes in :mod:`.stored`.
"""

from .route import ResponsesEndpoint as ResponsesEndpoint
from .stored import routes as routes

__all__ = ["ResponsesEndpoint", "routes"]
