"""The ASGI endpoint of ``POST /v1/responses``: from the body to the last
byte of the answer, a whole response or OpenAI's stream of events.

Event loop only. Each event carries its ``sequence_number``; the status
is sent with the first token, so a failed prefill is still an error status.
A failure after the stream began ends it with ``response.failed`` (or, for
the request's deadline, an ``error`` event).
"""

from __future__ import annotations

import copy
import functools
import json
import time
from typing import TYPE_CHECKING, Any

from ...events import FinalEvent, TokenEvent
from ..capabilities import Capabilities
from ..endpoint import GenerationEndpoint, last_parts, token_parts
from ..errors import OpenAIErrors
from .items import INPUT_ITEMS, chat_messages, image_urls
from .objects import Output, item_id, response_object, sse, usage
from .protocol import parse_responses_request
from .serving import Prepared, ResponsesServing
from .store import ResponseStore

if TYPE_CHECKING:
    from ...events import EventStream
    from ..answer import AnswerParser
    from ..errors import APIError
    from ..wire import RequestLog, ResponseWriter

__all__ = ["ResponsesEndpoint", "ResponsesErrors", "StreamErrors"]


class ResponsesErrors(OpenAIErrors):
    """OpenAI's error body; in a stream, an ``error`` event (one that has
    not begun its response object)."""

    def event(self, error: APIError) -> bytes:
        fields = {"code": error.code, "message": error.message, "param": error.param}
        return sse({"type": "error", "sequence_number": 0, **fields})


class StreamErrors(ResponsesErrors):
    """The errors of a stream under way: ``response.failed`` with the
    stream's next ``sequence_number``, its output so far and the error.

    Args:
        head: The stream's response object.
        output: The stream's output so far.
    """

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


class ResponsesEndpoint(GenerationEndpoint):
    """The ASGI endpoint of ``POST /v1/responses``.

    Runs on the event loop (the rest is :class:`~..endpoint.GenerationEndpoint`'s):
    the request is checked in one place (:class:`.serving.ResponsesServing`),
    its answer written as OpenAI's response object or events, and kept in
    :attr:`store` unless the request says ``store: false``.
    """

    route = "POST /v1/responses"
    errors = ResponsesErrors()

    @functools.cached_property
    def store(self) -> ResponseStore:
        """The stored responses, within the server's bound."""
        return ResponseStore(
            self.config.responses_store_max, self.config.responses_store_bytes
        )

    @functools.cached_property
    def serving(self) -> ResponsesServing:
        return ResponsesServing(self.config, self.store)

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_responses_request(body)
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            # Where each image is named: a stored turn's by its response.
            if stored is not None:
                images.extend("previous_response_id" for _ in stored.images)
        images.extend(param for param, _ in image_urls(request.items))
        log.stream = bool(request.stream)
        async with self.model(request.model, log) as (served, engine):
            capabilities = Capabilities.of(engine, served)
            prepared = await self.serving.prepare(request, capabilities)
            decoded = await self.decode_images(prepared.images, log)
            params = prepared.params
            async with self.generation(served, engine, params, decoded, log) as stream:
                parser = self.serving.answer_parser(request, capabilities, params)
                head = response_object(
                    request, item_id("resp"), int(time.time()), served.name
                )
                output = Output()
                if request.stream:
                    response.errors = StreamErrors(head, output)
                    final = await self._stream(
                        head, stream, response, log, parser, output
                    )
                else:
                    final = await self._whole(stream, log, parser, output, params)
                done = self._finish(head, output, final)
                if request.store is not False:
                    self._keep(done, prepared, output)
                if request.stream:
                    kind = (
                        "completed" if done["status"] == "completed" else "incomplete"
                    )
                    last = sse(output.event(f"response.{kind}", response=done))
                    if not response.started:
                        await response.start_stream(self._opening(head, output))
                    await response.send(last, more=False)
                else:
                    await response.json(json.dumps(done).encode())

    async def _whole(
        self,
        stream: EventStream,
        log: RequestLog,
        parser: AnswerParser | None,
        output: Output,
        params: Any,
    ) -> FinalEvent:
        """Every event, taken in batches; the answer's parts into ``output``."""
        events, final = await self.whole(stream, log)
        output.add(last_parts(parser, "".join(event.text for event in events), final))
        return final

    def _opening(self, head: dict[str, Any], output: Output) -> bytes:
        """``response.created`` and ``response.in_progress``: numbered 0 and 1."""
        return sse(output.event("response.created", response=head)) + sse(
            output.event("response.in_progress", response=head)
        )

    async def _stream(
        self,
        head: dict[str, Any],
        stream: EventStream,
        response: ResponseWriter,
        log: RequestLog,
        parser: AnswerParser | None,
        output: Output,
    ) -> FinalEvent:
        """The events of each token as it comes; the last one's are left to
        the caller (the answer's end)."""
        opening = self._opening(head, output)

        def encode(event: TokenEvent) -> bytes:
            return b"".join(sse(e) for e in output.add(token_parts(parser, event.text)))

        final = await self.stream_tokens(stream, response, log, opening, encode)
        tail = output.add(last_parts(parser, final.text, final))
        if not output.items:
            tail += output.add_empty_message()
        tail += output.close()
        data = b"".join(sse(e) for e in tail)
        if not response.started:
            await response.start_stream(opening + data)
        else:
            await response.send(data)
        return final

    def _finish(
        self, head: dict[str, Any], output: Output, final: FinalEvent
    ) -> dict[str, Any]:
        """The response object at the answer's end."""
        if not output.items:
            output.add_empty_message()
        output.close()
        done = copy.deepcopy(head)
        cut = final.finish_reason == "length"
        done["status"] = "incomplete" if cut else "completed"
        if cut:
            done["incomplete_details"] = {"reason": "max_output_tokens"}
        done["output"] = copy.deepcopy(output.items)
        done["usage"] = usage(final)
        return done

    def _keep(self, done: dict[str, Any], prepared: Prepared, output: Output) -> None:
        """Store the response and the conversation it ends, its output as the
        chat turns the same items make when sent back as input."""
        said = chat_messages(INPUT_ITEMS.validate_python(output.items, strict=False))
        messages = (*prepared.history, *said)
        urls = tuple(ref.url for ref in prepared.images)
        self.store.put(done, prepared.input_items, messages, urls)
