"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Event loop. The routes of the Anthropic Messages slice: the body is parsed
(:mod:`.protocol`), checked against the model once (:mod:`.serving`); a
generation runs through the model's gate and engine
(:class:`~..endpoint.GenerationEndpoint`: the deadline, the client watched,
every error answered in Anthropic's shape by this slice's table,
:mod:`.errors`), and the answer is written as Anthropic's (:mod:`.output`):
one message, or its event stream. A count runs the chat template and the
processor on the MLX thread (``Engine.count_tokens``) and generates
nothing. A query string (Claude Code's ``?beta=true``) changes neither.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import ClassVar

from ..endpoint import (
    GenerationEndpoint,
    ModelEndpoint,
    Reply,
    last_parts,
    send_last,
    token_parts,
)
from ..errors import APIError
from ..slots import Capabilities
from ..wire import ErrorShape, RequestLog, ResponseWriter
from .content import image_parts
from .output import (
    ANTHROPIC_ERRORS,
    Blocks,
    EventWriter,
    anthropic_error,
    message_id,
    stop_reason,
    tool_use_id,
)
from .protocol import MessagesRequest, parse_count_request, parse_messages_request
from .serving import MessagesServing

__all__ = ["CountTokensEndpoint", "MessagesEndpoint"]


class _AnthropicEndpoint(ModelEndpoint):
    """What both routes share: Anthropic's errors, and the one serving."""

    errors: ClassVar[ErrorShape] = ANTHROPIC_ERRORS

    @functools.cached_property
    def serving(self) -> MessagesServing:
        """The one place a request is checked against its model."""
        return MessagesServing(self.config)

    def error_for(self, exc: BaseException, images: Sequence[str]) -> APIError | None:
        return anthropic_error(exc, retry_after=self.config.retry_after, images=images)


class MessagesEndpoint(_AnthropicEndpoint, GenerationEndpoint[MessagesRequest]):
    """The ASGI endpoint of ``POST /v1/messages``."""

    route = "POST /v1/messages"
    call_id = staticmethod(tool_use_id)

    def parse(self, body: bytes, images: list[str]) -> MessagesRequest:
        request = parse_messages_request(body)
        images.extend(param for param, _ in image_parts(request.messages))
        return request

    async def send_whole(self, reply: Reply[MessagesRequest]) -> None:
        """The whole answer as one message, once the generation ended."""
        request, parser = reply.request, reply.parser
        events, final = await self.whole(reply.events, reply.log)
        blocks = Blocks(shown=request.thinking_shown)
        blocks.add(last_parts(parser, "".join(event.text for event in events), final))
        called = parser is not None and parser.called
        message = {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": blocks.content(),
            "stop_reason": stop_reason(final, called=called),
            "stop_sequence": final.stop_sequence,
            "usage": {
                "input_tokens": final.prompt_tokens,
                "output_tokens": final.completion_tokens,
                "cache_read_input_tokens": final.cached_tokens,
            },
        }
        await reply.response.json(json.dumps(message, ensure_ascii=False).encode())

    async def send_stream(self, reply: Reply[MessagesRequest]) -> None:
        """Anthropic's events."""
        parser = reply.parser
        writer = EventWriter(shown=reply.request.thinking_shown)
        head = writer.start(message_id(), reply.model)
        final = await self.stream_tokens(
            reply.events,
            reply.response,
            reply.log,
            head,
            lambda event: writer.parts(token_parts(parser, event.text)),
        )
        data = writer.parts(last_parts(parser, final.text, final))
        called = parser is not None and parser.called
        tail = data + writer.end(stop_reason(final, called=called), final)
        await send_last(reply.response, head, tail)


class CountTokensEndpoint(_AnthropicEndpoint):
    """The ASGI endpoint of ``POST /v1/messages/count_tokens``: the prompt's
    tokens through the model's chat template and processor, images
    included; it waits for no gate (it generates nothing)."""

    route = "POST /v1/messages/count_tokens"

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_count_request(body)
        images.extend(param for param, _ in image_parts(request.messages))
        async with self.model(request.model, log) as (served, engine):
            capabilities = Capabilities.of(engine, served)
            prepared = self.serving.prepare_count(request, capabilities)
            decoded = await self.decode_images(prepared.images, log)
            tokens = await engine.count_tokens(prepared.params, decoded)
        log.prompt_tokens = tokens
        await response.json(json.dumps({"input_tokens": tokens}).encode())
