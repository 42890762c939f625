"""The Messages API's doors, in Anthropic's shape (errors too). Event loop.
A query string (Claude Code's ``?beta=true``) changes neither."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from ...events import Engine, EventStream
from ..door import Call, Door
from ..generation import Generation, GenerationDoor, last_parts, send_last, token_parts
from ..serving_common import Prepared
from ..wire import ErrorShape, Opening
from .content import image_parts
from .output import (
    ANTHROPIC_ERRORS,
    PING,
    Blocks,
    EventWriter,
    message_id,
    stop_reason,
    tool_use_id,
)
from .protocol import (
    CountTokensRequest,
    MessagesRequest,
    parse_count_request,
    parse_messages_request,
)
from .serving import MessagesServing

if TYPE_CHECKING:
    from ..wire import RequestLog

__all__ = ["CountTokensEndpoint", "MessagesEndpoint"]


@dataclass(frozen=True)
class MessagesOpening(Opening):
    writer: EventWriter = field(kw_only=True)


class MessagesEndpoint(GenerationDoor[MessagesRequest]):
    route = "POST /v1/messages"
    api = "messages"
    errors: ClassVar[ErrorShape] = ANTHROPIC_ERRORS
    call_id = staticmethod(tool_use_id)

    @functools.cached_property
    def serving(self) -> MessagesServing:
        return MessagesServing(self.config)

    async def parse(self, body: bytes, places: list[str]) -> MessagesRequest:
        request = parse_messages_request(body)
        places.extend(param for param, _ in image_parts(request.messages))
        return request

    async def send_whole(
        self, call: Generation[MessagesRequest], output: EventStream
    ) -> None:
        request, parser = call.request, self.parser(call)
        events, final = await self.whole(output, call.log)
        blocks = Blocks(shown=request.thinking_shown)
        blocks.add(last_parts(parser, "".join(event.text for event in events), final))
        called = parser is not None and parser.called
        message = {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": call.served.name,
            "content": blocks.content(),
            "stop_reason": stop_reason(final, called=called),
            "stop_sequence": final.stop_sequence,
            "usage": {
                "input_tokens": final.prompt_tokens,
                "output_tokens": final.completion_tokens,
                "cache_read_input_tokens": final.cached_tokens,
            },
        }
        await call.response.json(json.dumps(message, ensure_ascii=False).encode())

    def opening(self, call: Generation[MessagesRequest]) -> MessagesOpening:
        """``message_start`` and a ``ping``; a ``ping`` as keep-alive."""
        writer = EventWriter(shown=call.request.thinking_shown)
        head = writer.start(message_id(), call.served.name)
        return MessagesOpening(head, PING, writer=writer)

    async def send_stream(
        self, call: Generation[MessagesRequest], output: EventStream
    ) -> None:
        parser = self.parser(call)
        opening = call.opening or self.opening(call)
        assert isinstance(opening, MessagesOpening)
        writer, head = opening.writer, opening.head
        final = await self.stream_tokens(
            output,
            call.response,
            call.log,
            head,
            lambda event: writer.parts(token_parts(parser, event.text)),
        )
        data = writer.parts(last_parts(parser, final.text, final))
        called = parser is not None and parser.called
        tail = data + writer.end(stop_reason(final, called=called), final)
        await send_last(call.response, head, tail)


class CountTokensEndpoint(Door[CountTokensRequest, Engine, Prepared, int]):
    """The door of ``POST /v1/messages/count_tokens``: the prompt's tokens
    through the model's chat template and processor, images included; it
    takes no turn of the gate (it generates nothing)."""

    route = "POST /v1/messages/count_tokens"
    errors: ClassVar[ErrorShape] = ANTHROPIC_ERRORS
    gated = False

    @functools.cached_property
    def serving(self) -> MessagesServing:
        return MessagesServing(self.config)

    async def parse(self, body: bytes, places: list[str]) -> CountTokensRequest:
        request = parse_count_request(body)
        places.extend(param for param, _ in image_parts(request.messages))
        return request

    async def prepare(self, request: CountTokensRequest, engine: Engine) -> Prepared:
        return self.serving.prepare_count(request, engine.facts)

    async def media(
        self, prepared: Prepared, engine: Engine, log: RequestLog
    ) -> Prepared:
        decoded = await self.decode_images(prepared.images, log)
        return replace(prepared, decoded=decoded)

    @asynccontextmanager
    async def run(
        self, call: Call[CountTokensRequest, Engine, Prepared]
    ) -> AsyncIterator[int]:
        prepared = call.prepared
        yield await call.engine.count_tokens(prepared.params, prepared.decoded)

    async def send_whole(
        self, call: Call[CountTokensRequest, Engine, Prepared], output: int
    ) -> None:
        call.log.prompt_tokens = output
        await call.response.json(json.dumps({"input_tokens": output}).encode())
