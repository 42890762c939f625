"""The door of ``POST /v1/responses``: a whole response or OpenAI's stream
of events. Event loop only. A failure after the stream began ends it with
``response.failed`` (or, for the request's deadline, an ``error`` event)."""

from __future__ import annotations

import copy
import functools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...events import EventStream, FinalEvent, TokenEvent
from ..errors import OpenAIErrors
from ..generation import Generation, GenerationDoor, last_parts, send_last, token_parts
from ..wire import KEEP_ALIVE, Opening
from .items import INPUT_ITEMS, chat_messages, image_urls
from .objects import Output, item_id, response_object, sse, tool_call_id, usage
from .protocol import ResponsesRequest, parse_responses_request
from .serving import Continued, ResponsesServing
from .store import open_store

if TYPE_CHECKING:
    from ..answer_parser import AnswerParser
    from ..door import Wiring
    from ..errors import APIError
    from ..serving_common import Prepared

__all__ = ["ResponsesEndpoint", "ResponsesErrors", "StreamErrors"]


@dataclass(frozen=True)
class ResponsesOpening(Opening):
    response: dict[str, Any] = field(kw_only=True)
    items: Output = field(kw_only=True)


class ResponsesErrors(OpenAIErrors):
    """OpenAI's error body; in a stream, an ``error`` event (one that has
    not begun its response object)."""

    def event(self, error: APIError) -> bytes:
        fields = {"code": error.code, "message": error.message, "param": error.param}
        return sse({"type": "error", "sequence_number": 0, **fields})


class StreamErrors(ResponsesErrors):
    """The errors of a stream under way: ``response.failed`` with the
    stream's next ``sequence_number``, its output so far and the error."""

    def __init__(self, head: dict[str, Any], output: Output) -> None:
        self.head = head
        self.output = output

    def event(self, error: APIError) -> bytes:
        failed = copy.deepcopy(self.head)
        failed["status"] = "failed"
        failed["output"] = copy.deepcopy(self.output.items)
        failed["error"] = {
            "code": error.code or "server_error",
            "message": error.message,
        }
        return sse(self.output.event("response.failed", response=failed))


class ResponsesEndpoint(GenerationDoor[ResponsesRequest]):
    """Answers are kept in :attr:`store` unless the request says
    ``store: false``."""

    route = "POST /v1/responses"
    prompt = "input"
    api = "responses"
    errors = ResponsesErrors()
    call_id = staticmethod(tool_call_id)

    def __init__(self, wiring: Wiring) -> None:
        super().__init__(wiring)
        # Opened now: a state_dir that cannot hold it fails the start.
        self.store = open_store(self.config)
        wiring.closing.append(self.store.aclose)
        if wiring.metrics is not None:
            wiring.metrics.store = self.store

    @functools.cached_property
    def serving(self) -> ResponsesServing:
        return ResponsesServing(self.config, self.store)

    async def parse(self, body: bytes, places: list[str]) -> ResponsesRequest:
        request = parse_responses_request(body)
        if request.previous_response_id is not None:
            # Where each image is named: a stored turn's by its response.
            stored = self.store.image_count(request.previous_response_id) or 0
            places.extend("previous_response_id" for _ in range(stored))
        places.extend(param for param, _ in image_urls(request.items))
        return request

    async def send_whole(
        self, call: Generation[ResponsesRequest], output: EventStream
    ) -> None:
        head, items, parser = self._head(call), Output(), self.parser(call)
        events, final = await self.whole(output, call.log)
        text = "".join(event.text for event in events)
        done, _ = await self._finish(call, head, items, final, text, parser)
        await call.response.json(json.dumps(done).encode())

    def opening(self, call: Generation[ResponsesRequest]) -> ResponsesOpening:
        """``response.created`` and ``response.in_progress``; an SSE comment
        as keep-alive."""
        head, items = self._head(call), Output()
        opening = sse(items.event("response.created", response=head)) + sse(
            items.event("response.in_progress", response=head)
        )
        failed = StreamErrors(head, items).event
        return ResponsesOpening(opening, KEEP_ALIVE, failed, response=head, items=items)

    async def send_stream(
        self, call: Generation[ResponsesRequest], output: EventStream
    ) -> None:
        """The last event is sent once the response is stored."""
        began = call.opening or self.opening(call)
        assert isinstance(began, ResponsesOpening)
        head, items, response = began.response, began.items, call.response
        parser = self.parser(call)
        opening = began.head

        def encode(event: TokenEvent) -> bytes:
            parts = token_parts(parser, event.text)
            return b"".join(sse(e) for e in items.add(parts))

        final = await self.stream_tokens(
            output,
            response,
            call.log,
            opening,
            encode,
            failed=began.failed,
        )
        done, data = await self._finish(call, head, items, final, final.text, parser)
        kind = "completed" if done["status"] == "completed" else "incomplete"
        last = sse(items.event(f"response.{kind}", response=done))
        await send_last(response, opening, data + last)

    def _head(self, call: Generation[ResponsesRequest]) -> dict[str, Any]:
        return response_object(
            call.request, item_id("resp"), int(time.time()), call.served.name
        )

    async def _finish(
        self,
        call: Generation[ResponsesRequest],
        head: dict[str, Any],
        output: Output,
        final: FinalEvent,
        text: str,
        parser: AnswerParser | None,
    ) -> tuple[dict[str, Any], bytes]:
        """The answer's last ``text`` into ``output``; the response object at
        the answer's end, stored unless ``store: false``, and the events of
        that end."""
        events = output.add(last_parts(parser, text, final))
        if not output.items:
            events += output.add_empty_message()
        cut = final.finish_reason == "length"
        events += output.close("incomplete" if cut else "completed")
        done = copy.deepcopy(head)
        done["status"] = "incomplete" if cut else "completed"
        if cut:
            done["incomplete_details"] = {"reason": "max_output_tokens"}
        done["output"] = copy.deepcopy(output.items)
        done["usage"] = usage(final)
        if call.request.store is not False:
            # Not kept (past the store's bound, a full disk): the answer says
            # so with "store": false.
            kept = await self._keep(done, call.prepared, output)
            done["store"] = kept
        return done, b"".join(sse(event) for event in events)

    async def _keep(
        self, done: dict[str, Any], prepared: Prepared, output: Output
    ) -> bool:
        """Store the response and the conversation it ends, its output as the
        chat turns the same items make when sent back as input; whether it
        was kept."""
        assert isinstance(prepared, Continued), "this door's prepare made it"
        said = chat_messages(INPUT_ITEMS.validate_python(output.items, strict=False))
        messages = (*prepared.history, *said)
        urls = tuple(ref.url for ref in prepared.images)
        return await self.store.put(done, prepared.input_items, messages, urls)
