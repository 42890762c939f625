"""What the chat kind's generation doors (chat completions, Messages,
Responses) share: their :class:`~.door.Door` steps, and their writers'
helpers.

Event loop only.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Generic

import anyio

from ..events import (
    Engine,
    EventStream,
    FinalEvent,
    GenerationParams,
    PromptProgress,
    TokenEvent,
)
from .answer_parser import answer_parser
from .door import Call, Door
from .gate import Charge, kv_tokens, price
from .serving_common import Prepared, RequestT, Serving, check_media

if TYPE_CHECKING:
    from PIL import Image

    from ..events import Event
    from .answer_parser import AnswerParser, Part
    from .errors import APIError
    from .wire import RequestLog, ResponseWriter

__all__ = [
    "Generation",
    "GenerationDoor",
    "charge_of",
    "generation",
    "joined",
    "last_parts",
    "send_last",
    "token_parts",
]

#: A generation request as a door's writers see it.
Generation = Call[RequestT, Engine, Prepared]


class GenerationDoor(Door[RequestT, Engine, Prepared, EventStream], Generic[RequestT]):
    """A door that generates; its API's ``serving`` checks the request, and
    ``call_id`` makes a tool call's id in the API's own form."""

    call_id: Callable[[], str]

    @property
    @abstractmethod
    def serving(self) -> Serving[RequestT]: ...

    def streamed(self, request: RequestT) -> bool:
        return bool(request.stream)

    def priority(self, prepared: Prepared) -> int:
        return prepared.params.priority

    def charge(self, prepared: Prepared, engine: Engine) -> Charge:
        return charge_of(engine, prepared.params, prepared.decoded)

    async def prepare(self, request: RequestT, engine: Engine) -> Prepared:
        prepared = await self.serving.prepare(request, engine.facts)
        check_media(engine.facts, prepared.images, prepared.videos, prepared.audios)
        return prepared

    async def media(
        self, prepared: Prepared, engine: Engine, log: RequestLog
    ) -> Prepared:
        decoders = self.wiring.decoders
        images = await self.decode_images(prepared.images, log)
        params = prepared.params
        if prepared.videos:
            videos = await decoders.videos(prepared.videos)
            params = dataclasses.replace(params, videos=tuple(videos))
        taken = engine.facts.audio_input
        if prepared.audios and taken is not None:  # check_media refused None
            audios = await decoders.audios(prepared.audios, taken)
            params = dataclasses.replace(params, audios=tuple(audios))
        return dataclasses.replace(prepared, params=params, decoded=images)

    def run(
        self, call: Generation[RequestT]
    ) -> AbstractAsyncContextManager[EventStream]:
        """The generation, once the engine took it: its charge is then exact,
        and its announced stream begins."""
        return self._taken(call)

    @asynccontextmanager
    async def _taken(self, call: Generation[RequestT]) -> AsyncIterator[EventStream]:
        prepared = call.prepared
        async with generation(call.engine, prepared.params, prepared.decoded) as events:
            if not call.log.stream:  # asked before its first step: one wake-up
                events.batched(None)
            taken = await events.accepted()
            if taken is not None:
                call.place.settle(kv_tokens(prepared.params, taken.total))
                await call.response.begin()
            yield events

    def parser(self, call: Generation[RequestT]) -> AnswerParser | None:
        """The answer's parser (None: its text is its content)."""
        return answer_parser(call.engine.facts, call.prepared, self.call_id)

    async def whole(
        self, stream: EventStream, log: RequestLog
    ) -> tuple[list[Event], FinalEvent]:
        """Every event of the generation and its final one, once it ended:
        one wake-up of the event loop for the answer, not one per token."""
        taken: list[Event] = []
        final: FinalEvent | None = None
        async for events in stream.batched(None):
            await self.wiring.turns.checkpoint()
            for event in events:
                log.record(event, whole=True)
                taken.append(event)
                if isinstance(event, FinalEvent):
                    final = event
        assert final is not None, "a generation always ends with a FinalEvent"
        return taken, final

    async def stream_tokens(
        self,
        stream: EventStream,
        response: ResponseWriter,
        log: RequestLog,
        head: bytes,
        encode: Callable[[TokenEvent], bytes],
        *,
        failed: Callable[[APIError], bytes] | None = None,
        media_type: bytes | None = None,
        progress: Callable[[PromptProgress], bytes] | None = None,
    ) -> FinalEvent:
        """Send the tokens' ``encode``-d data as they come, ``head`` first
        with the first token unless the stream began (else the status goes
        with it, so a failed prefill is still an error status), at most one
        write each ``stream_write_interval`` seconds, as server-sent events
        unless ``media_type`` says otherwise; before them, each of the
        prompt's ``progress`` (where the stream began); the final event,
        unsent, for the caller to end the answer with."""
        if progress is not None and response.started:
            async with aclosing(stream.prefill()) as prefill:
                async for moved in prefill:
                    await response.send(progress(moved))
        interval = self.config.stream_write_interval
        final: FinalEvent | None = None
        async with aclosing(stream.flowing(interval)) as flowing:
            async for events in flowing:  # it ends after the final event
                await self.wiring.turns.checkpoint()
                for event in events:
                    log.record(event)
                tokens = [e for e in events if isinstance(e, TokenEvent)]
                data = b"".join(encode(event) for event in joined(tokens))
                response.answering()
                if not response.started:
                    await response.start_stream(
                        head + data, failed=failed, media_type=media_type
                    )
                elif data:
                    await response.send(data)
                if isinstance(events[-1], FinalEvent):
                    final = events[-1]
        assert final is not None, "a generation always ends with a FinalEvent"
        return final


def charge_of(
    engine: Engine, params: GenerationParams, images: Sequence[Image.Image]
) -> Charge:
    """What a generation of ``params`` is charged at its entry (:func:`.price`),
    at its model's bytes a token."""
    facts = engine.facts
    per_token = facts.kv_bytes_per_token or engine.counters().kv_bytes_per_token
    ids, cut = params.prompt, params.truncate_prompt_tokens is not None
    least = len(ids) if isinstance(ids, tuple) and not cut else 0
    return price(params, images, per_token, least)


@asynccontextmanager
async def generation(
    engine: Engine, params: GenerationParams, images: Sequence[Image.Image]
) -> AsyncIterator[EventStream]:
    """A generation's events, closed on the MLX thread when the block ends,
    however it ends. Take the gate's turn around it."""
    stream = engine.stream(params, images)
    try:
        yield stream
    finally:
        # Shielded: the close is queued on the MLX thread before the gate's
        # turn is given back, even if we were cancelled, so (FIFO) it runs
        # before the next generation starts.
        with anyio.CancelScope(shield=True):
            await stream.aclose()


def joined(tokens: Sequence[TokenEvent]) -> list[TokenEvent]:
    """``tokens`` with each run of those without log-probabilities joined
    into one event of their text (those with them stay one a token)."""
    out: list[TokenEvent] = []
    for token in tokens:
        if token.logprobs is None and out and out[-1].logprobs is None:
            out[-1] = TokenEvent(out[-1].text + token.text)
        else:
            out.append(token)
    return out


def token_parts(parser: AnswerParser | None, text: str) -> list[Part]:
    return parser.feed(text) if parser is not None else [text]


def last_parts(parser: AnswerParser | None, text: str, final: FinalEvent) -> list[Part]:
    """The parts of the answer's last ``text`` and its end (``final``): as
    parsed (a call cut by ``max_tokens`` ended as cut), else the text."""
    if parser is None:
        return [text]
    return [*parser.feed(text), *parser.end(cut=final.finish_reason == "length")]


async def send_last(response: ResponseWriter, head: bytes, tail: bytes) -> None:
    """End a stream with ``tail``; ``head`` first if no token opened it (the
    answer had none)."""
    if not response.started:
        await response.start_stream(head)
    await response.send(tail, more=False)
