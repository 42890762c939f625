"""The doors of ``POST /api/chat`` and ``POST /api/generate``, in Ollama's
shape (errors too): NDJSON lines unless ``"stream": false``. Event loop.
A request with no turn (no prompt) loads the model, or with ``keep_alive``
0 unloads it; any other sets how long the model stays once idle."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from ...events import EventStream, TokenEvent
from ..door import Door
from ..generation import Generation, GenerationDoor, last_parts, token_parts
from ..validation import parse_request
from ..wire import ErrorShape, random_hex
from .output import (
    NDJSON,
    OLLAMA_ERRORS,
    Turn,
    created_at,
    line,
    logprob,
    metrics,
)
from .protocol import ChatRequest, GenerateRequest
from .serving import OllamaServing, image_places

if TYPE_CHECKING:
    from ..answer_parser import AnswerParser
    from ..served_models import ServedModel
    from ..wire import RequestLog, ResponseWriter

__all__ = ["ChatEndpoint", "GenerateEndpoint", "Lifecycle", "load_seconds"]

#: Seconds the request waited for its model's load (Ollama's load_duration).
_LOAD_SECONDS: ContextVar[float] = ContextVar("ollama_load_seconds", default=0.0)


def load_seconds() -> float:
    return _LOAD_SECONDS.get()


class Lifecycle(Protocol):
    """What a request that may only load or unload its model says."""

    @property
    def model(self) -> str: ...

    @property
    def keep_alive(self) -> float | None: ...

    @property
    def empty(self) -> bool: ...


LifecycleT = TypeVar("LifecycleT", bound=Lifecycle)


class OllamaDoor(Door[LifecycleT, Any, Any, Any]):
    """What Ollama's doors share: its errors, the load and unload of a
    request with nothing to do, ``keep_alive``, and the load's time."""

    errors: ClassVar[ErrorShape] = OLLAMA_ERRORS

    def done(self, request: LifecycleT, reason: str) -> dict[str, Any]:
        """The answer to a load or an unload (``done_reason``)."""
        return {"done": True, "done_reason": reason}

    async def serve(
        self, request: LifecycleT, response: ResponseWriter, log: RequestLog
    ) -> None:
        if not request.empty:
            await super().serve(request, response, log)
            return
        served = self.wiring.models.get(request.model)
        log.model = served.name
        served.check_kind(self.kind, self.route.partition(" ")[2])
        residency = self.wiring.residency
        if request.keep_alive == 0:
            await residency.unload(served, "keep_alive 0")
            reason = "unload"
        else:
            async with residency.use(served):
                pass
            residency.keep_alive(served, request.keep_alive)
            reason = "load"
        answer = {"model": request.model, "created_at": created_at()}
        body = line({**answer, **self.done(request, reason)})
        if self.streamed(request):
            await response.whole(body, [(b"content-type", NDJSON)])
        else:
            await response.json(body)

    @asynccontextmanager
    async def resident(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, Any]]:
        start = time.perf_counter()
        async with super().resident(name, log) as held:
            _LOAD_SECONDS.set(time.perf_counter() - start)
            yield held

    def kept(self, served: ServedModel, request: LifecycleT) -> None:
        """Keep ``served`` loaded as long as ``request`` asks, once idle."""
        self.wiring.residency.keep_alive(served, request.keep_alive)


RequestT = TypeVar("RequestT", bound=ChatRequest | GenerateRequest)


class _Generating(OllamaDoor[RequestT], GenerationDoor[RequestT]):
    """A door that generates: its pieces' fields (:meth:`piece`) are the
    one difference between chat and generate."""

    call_id = staticmethod(lambda: f"call_{random_hex(64)}")
    model_type: ClassVar[type[ChatRequest] | type[GenerateRequest]]

    @functools.cached_property
    def serving(self) -> OllamaServing:
        return OllamaServing(self.config)

    def streamed(self, request: RequestT) -> bool:
        return request.stream is not False

    async def parse(self, body: bytes, places: list[str]) -> RequestT:
        request: RequestT = parse_request(self.model_type, body)  # type: ignore[assignment]
        places.extend(place for place, _ in image_places(request))
        return request

    def piece(
        self, content: str, thinking: str, calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def done(self, request: RequestT, reason: str) -> dict[str, Any]:
        return {**self.piece("", ""), "done": True, "done_reason": reason}

    def run(
        self, call: Generation[RequestT]
    ) -> AbstractAsyncContextManager[EventStream]:
        self.kept(call.served, call.request)
        return super().run(call)

    def _head(self, call: Generation[RequestT]) -> dict[str, Any]:
        return {"model": call.request.model, "created_at": created_at()}

    async def send_whole(self, call: Generation[RequestT], output: EventStream) -> None:
        parser = self.parser(call)
        events, final = await self.whole(output, call.log)
        turn = Turn()
        turn.add(last_parts(parser, "".join(event.text for event in events), final))
        answer = {**self._head(call), **self.piece_of(turn)}
        if call.request.logprobs:
            answer["logprobs"] = [
                logprob(event.logprobs)
                for event in events
                if isinstance(event, TokenEvent) and event.logprobs is not None
            ]
        answer |= {"done": True, "done_reason": final.finish_reason}
        answer |= metrics(final, call.log.start, load_seconds())
        await call.response.json(json.dumps(answer, ensure_ascii=False).encode())

    def piece_of(self, turn: Turn) -> dict[str, Any]:
        """The whole answer's fields."""
        message = turn.message()
        return self.piece(
            message["content"], message.get("thinking", ""), message.get("tool_calls")
        )

    async def send_stream(
        self, call: Generation[RequestT], output: EventStream
    ) -> None:
        parser = self.parser(call)
        turn = Turn()
        head = self._head(call)

        def encode(event: TokenEvent) -> bytes:
            turn.add(token_parts(parser, event.text))
            content, thinking = turn.take()
            data: dict[str, Any] = {}
            if event.logprobs is not None:
                data["logprobs"] = [logprob(event.logprobs)]
            elif not content and not thinking:
                return b""
            return line(
                {**head, **self.piece(content, thinking), **data, "done": False}
            )

        final = await self.stream_tokens(
            output, call.response, call.log, b"", encode, media_type=NDJSON
        )
        turn.add(last_parts(parser, final.text, final))
        content, thinking = turn.take()
        tail = []
        if content or thinking:
            tail.append(line({**head, **self.piece(content, thinking), "done": False}))
        calls = turn.calls()
        if calls:
            tail.append(line({**head, **self.piece("", "", calls), "done": False}))
        last = {**head, **self.piece("", ""), "done": True}
        last |= {"done_reason": final.finish_reason}
        last |= metrics(final, call.log.start, load_seconds())
        tail.append(line(last))
        await call.response.send(b"".join(tail), more=False)


class ChatEndpoint(_Generating[ChatRequest]):
    route = "POST /api/chat"
    api = "ollama_chat"
    model_type = ChatRequest

    def piece(
        self, content: str, thinking: str, calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


class GenerateEndpoint(_Generating[GenerateRequest]):
    route = "POST /api/generate"
    api = "ollama_generate"
    prompt = "prompt"
    model_type = GenerateRequest

    def piece(
        self, content: str, thinking: str, calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        piece: dict[str, Any] = {"response": content}
        if thinking:
            piece["thinking"] = thinking
        return piece

    def parser(self, call: Generation[GenerateRequest]) -> AnswerParser | None:
        """None for a raw prompt: no template opened a reasoning or a call."""
        return None if call.request.raw else super().parser(call)
