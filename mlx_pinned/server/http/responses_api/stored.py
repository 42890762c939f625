"""The stored responses' routes: ``GET`` (whole, or replayed as a stream)
and ``DELETE /v1/responses/{id}``, and ``GET /v1/responses/{id}/input_items``.

Event loop only; a refusal is raised, and the app's error edge answers it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import APIError
from .objects import replayed, sse
from .serving import unreadable
from .store import DamagedResponseError

if TYPE_CHECKING:
    from starlette.requests import Request

    from .route import ResponsesEndpoint
    from .store import ResponseStore, StoredResponse

__all__ = ["routes"]

_NO_CACHE = {"cache-control": "no-cache"}


def routes(endpoint: ResponsesEndpoint) -> list[Route]:
    """The Responses API's routes: the door's, and its stored responses'."""
    store = endpoint.store
    return [
        Route("/v1/responses", endpoint, methods=["POST"]),
        Route(
            "/v1/responses/{response_id}",
            functools.partial(retrieve, store),
            methods=["GET"],
        ),
        Route(
            "/v1/responses/{response_id}",
            functools.partial(delete, store),
            methods=["DELETE"],
        ),
        Route(
            "/v1/responses/{response_id}/input_items",
            functools.partial(input_items, store),
            methods=["GET"],
        ),
    ]


async def _found(store: ResponseStore, request: Request) -> StoredResponse:
    response_id = request.path_params["response_id"]
    try:
        stored = await store.get(response_id)
    except DamagedResponseError as exc:
        raise unreadable(exc, "response_id") from None
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response found with id '{response_id}': it was not stored "
        "(store=false), was deleted, or was evicted by the store's bound.",
        param="response_id",
        code="not_found",
    )


async def retrieve(store: ResponseStore, request: Request) -> Response:
    """The stored response; with ``stream=true``, the stream of events its
    ``POST`` would have sent (after the event ``starting_after``, if
    given)."""
    query = request.query_params
    stream = _flag(query.get("stream", "false"), "stream")
    after = query.get("starting_after", "-1")
    digits = after.removeprefix("-")
    if not (digits.isascii() and digits.isdigit() and len(digits) < 10):
        raise _invalid("starting_after", after, "give an event's sequence_number")
    response = (await _found(store, request)).response
    if not stream:
        return JSONResponse(response)
    events = replayed(response)[max(int(after), -1) + 1 :]
    body = b"".join(sse(event) for event in events)
    return Response(body, media_type="text/event-stream", headers=_NO_CACHE)


async def delete(store: ResponseStore, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not await store.delete(response_id):
        raise _not_found(response_id)
    body = {"id": response_id, "object": "response.deleted", "deleted": True}
    return JSONResponse(body)


async def input_items(store: ResponseStore, request: Request) -> Response:
    stored = await _found(store, request)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _invalid("order", order, "use 'asc' or 'desc'")
    limit_text = query.get("limit", "20")
    digits = limit_text.isascii() and limit_text.isdigit()
    if not digits or len(limit_text) > 3 or not 1 <= int(limit_text) <= 100:
        raise _invalid("limit", limit_text, "give 1 to 100")
    items: list[dict[str, Any]] = list(stored.input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[: int(limit_text)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


def _flag(text: str, param: str) -> bool:
    if text not in ("true", "false"):
        raise _invalid(param, text, "use 'true' or 'false'")
    return text == "true"


def _invalid(param: str, text: str, what: str) -> APIError:
    return APIError(
        400,
        f"Invalid value for '{param}': {text[:40]!r}; {what}.",
        param=param,
        code="invalid_value",
    )
