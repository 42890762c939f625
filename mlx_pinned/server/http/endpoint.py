"""What every API's generation route shares, whatever its shapes.

Event loop only. :class:`ModelEndpoint` is a plain ASGI endpoint rather
than a Starlette request handler, so that one ``try``/``finally`` owns the
request from its first byte to its last: the model's turn and the stream on
the MLX thread are always given back, whether the request ends, fails, or
the client goes away. It reads the body, keeps the deadline, watches the
client, holds the model, takes the gate's turn and closes the stream, and
answers every error through the slice's table
(:meth:`ModelEndpoint.error_for`) in the slice's shape
(:attr:`ModelEndpoint.errors`). :class:`GenerationEndpoint` is the one
skeleton of a generation (parse, prepare, decode the media, generate, write
the answer whole or streamed); a slice (an API) supplies its protocol, its
preparation and its writers.

A status code is chosen only before the first byte of the response: prefill
runs before the response starts, so a bad request or a failed prefill is a
4xx/5xx, never a 200 that carries an error. A failure after a stream began is
sent as the API's error event.

Each request has one deadline (``request_timeout``) for everything after its
body was read: images, the wait for the model and the generation. Past it the
answer is a 504 (an error event if the stream began) and the generation is
closed on the MLX thread.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, cast

import anyio

from ..events import FinalEvent, TokenEvent
from .answer_parser import answer_parser
from .errors import APIError, api_error, internal_error, thread_unavailable, timed_out
from .serving_common import RequestT, Serving, check_media
from .slots import Capabilities
from .wire import (
    OPENAI_ERRORS,
    Body,
    Disconnected,
    ErrorShape,
    RequestLog,
    ResponseWriter,
    cancel_on_disconnect,
    read_body,
)

if TYPE_CHECKING:
    from PIL import Image
    from starlette.types import Receive, Scope, Send

    from mlx_pinned import MLXThread

    from ..config import ModelKind, ServerConfig
    from ..events import Engine, Event, EventStream, GenerationParams, Resident
    from ..media import (
        Audio,
        AudioInput,
        AudioRef,
        ImageRef,
        LoadAudios,
        LoadImages,
        LoadVideos,
        Video,
        VideoRef,
    )
    from .answer_parser import AnswerParser, Part
    from .metrics import ServerMetrics
    from .residency import Residency
    from .served_models import ServedModel, ServedModels
    from .serving_common import Prepared
    from .turns import LoopTurns

__all__ = [
    "GenerationEndpoint",
    "ModelEndpoint",
    "Reply",
    "last_parts",
    "send_last",
    "token_parts",
]

logger = logging.getLogger("mlx_pinned.server")


class ModelEndpoint(ABC):
    """The ASGI endpoint of one API's route that uses a model.

    Runs on the event loop; the generation runs on ``thread``, through the
    engine of the model the request names (held through ``residency``,
    which loads it first when needed), after a turn of that model's gate. A
    client that disconnects, while waiting or while generating, cancels its
    request: a generation that has not started never starts, a running one
    is closed on the MLX thread at its next token.

    Attributes:
        route: The method and path, for the log line.
        errors: How this API writes an error (OpenAI's, unless overridden).
        kind: The kind of model it serves (a model of another kind is a 400).
    """

    route: ClassVar[str]
    errors: ClassVar[ErrorShape] = OPENAI_ERRORS
    kind: ClassVar[ModelKind] = "chat"

    def __init__(
        self,
        config: ServerConfig,
        thread: MLXThread,
        models: ServedModels,
        residency: Residency,
        load_images: LoadImages,
        turns: LoopTurns,
        *,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.config = config
        self.thread = thread
        self.models = models
        self.residency = residency
        self.load_images = load_images
        self.turns = turns
        self.metrics = metrics

    @abstractmethod
    async def handle(
        self, body: Body, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        """Parse ``body``, use the model through :meth:`model` (and
        :meth:`generation`), and write the answer; raise for any error (the
        base answers it). Add to ``images`` where each image of the request
        is, in prompt order, once parsed, so a refused one can be named."""

    def error_for(self, exc: BaseException, images: Sequence[str]) -> APIError | None:
        """This API's table: the answer for a known failure, None for a bug."""
        return api_error(exc, retry_after=self.config.retry_after, images=images)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = RequestLog(
            start=time.perf_counter(), client=_client(scope), route=self.route
        )
        response = ResponseWriter(send, self.errors)
        try:
            await self.turns.checkpoint()
            body = await read_body(scope, receive, self.config.max_body_bytes)
            timeout = self.config.request_timeout
            deadline = anyio.current_time() + timeout if timeout else math.inf
            # One scope: the deadline cancels it, and so does the watcher
            # when the client goes away (it marks the log first).
            with anyio.CancelScope(deadline=deadline) as limit:
                async with cancel_on_disconnect(receive, limit, response, log):
                    await self._answer(body, response, log)
            if limit.cancelled_caught and not log.disconnected:
                await response.error(timed_out(timeout))
        except Disconnected:
            log.disconnected = True
        except APIError as error:
            await response.error(error)
        finally:
            log.status = response.status or (499 if log.disconnected else 0)
            log.emit()
            if self.metrics is not None:
                self.metrics.observe(log)

    async def _answer(
        self, body: Body, response: ResponseWriter, log: RequestLog
    ) -> None:
        """Handle the request; every error becomes an answer (none escapes)."""
        images: list[str] = []
        try:
            if self.thread.closed:  # fail fast: nothing will ever run
                raise thread_unavailable()
            await self.handle(body, response, log, images)
        except Exception as exc:
            error = self.error_for(exc, images)
            if error is None:
                logger.exception("%s failed", self.route)
                error = internal_error()
            elif error.status == 500:  # the body names nothing: the log does
                logger.error("%s failed", self.route, exc_info=exc)
            await response.error(error)

    @asynccontextmanager
    async def resident(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, Resident]]:
        """The model served as ``name``, of this endpoint's kind, and its
        engine, held for the block: it is not unloaded under it (and is
        loaded first, if needed)."""
        served = self.models.get(name)
        log.model = served.name
        served.check_kind(self.kind, self.route.partition(" ")[2])
        async with self.residency.use(served) as engine:
            yield served, engine

    @asynccontextmanager
    async def model(
        self, name: str, log: RequestLog
    ) -> AsyncIterator[tuple[ServedModel, Engine]]:
        """:meth:`resident` of a chat model (the chat kind's engine)."""
        async with self.resident(name, log) as (served, engine):
            yield served, cast("Engine", engine)

    async def decode_images(
        self, refs: Sequence[ImageRef], log: RequestLog
    ) -> list[Image.Image]:
        """The request's images, decoded off the loop (counted in ``log``)."""
        log.images = len(refs)
        return await self.load_images(refs)

    @asynccontextmanager
    async def generation(
        self,
        served: ServedModel,
        engine: Engine,
        params: GenerationParams,
        images: Sequence[Image.Image],
        log: RequestLog,
    ) -> AsyncIterator[EventStream]:
        """The generation's events, after a turn of the model's gate; closed
        on the MLX thread when the block ends, however it ends."""
        arrived = time.perf_counter()
        async with served.gate.turn(params.priority):
            log.queued = time.perf_counter() - arrived
            stream = engine.stream(params, images)
            try:
                yield stream
            finally:
                # Shielded: the close is queued on the MLX thread before the
                # slot is given back, even if we were cancelled, so (FIFO) it
                # runs before the next generation starts.
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    async def whole(
        self, stream: EventStream, log: RequestLog
    ) -> tuple[list[Event], FinalEvent]:
        """Every event of the generation and its final one, once it ended:
        one wake-up of the event loop for the answer, not one per token."""
        taken: list[Event] = []
        final: FinalEvent | None = None
        async for events in stream.batched(None):
            await self.turns.checkpoint()
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
    ) -> FinalEvent:
        """Send the tokens' ``encode``-d data as they come, ``head`` first
        with the first token (the status goes with it, so a failed prefill
        is still an error status); the final event, unsent, for the caller
        to end the answer with.

        The tokens that are in together go out in one write, those without
        log-probabilities as one event of their joined text; writes are
        ``stream_write_interval`` apart at least (the setting), so a fast
        model's tokens cost fewer writes and fewer events to parse.
        """
        interval = self.config.stream_write_interval
        final: FinalEvent | None = None
        async with aclosing(stream.flowing(interval)) as flowing:
            async for events in flowing:  # it ends after the final event
                await self.turns.checkpoint()
                for event in events:
                    log.record(event)
                tokens = [e for e in events if isinstance(e, TokenEvent)]
                data = b"".join(encode(event) for event in joined(tokens))
                if not response.started:
                    await response.start_stream(head + data)
                elif data:
                    await response.send(data)
                if isinstance(events[-1], FinalEvent):
                    final = events[-1]
        assert final is not None, "a generation always ends with a FinalEvent"
        return final


@dataclass(frozen=True, slots=True)
class Reply(Generic[RequestT]):
    """One request's generation, as its API's writer takes it.

    Attributes:
        request: The parsed request.
        prepared: It, checked against its model.
        model: The served name, for the answer.
        events: The generation's events.
        parser: The answer's parser (None: its text is its content).
        response: Where the answer goes.
        log: The request's log line.
    """

    request: RequestT
    prepared: Prepared
    model: str
    events: EventStream
    parser: AnswerParser | None
    response: ResponseWriter
    log: RequestLog


async def _no_videos(refs: Sequence[VideoRef]) -> list[Video]:
    raise refs[0].error("this server decodes no videos.", "videos_unsupported")


async def _no_audios(refs: Sequence[AudioRef], taken: AudioInput) -> list[Audio]:
    raise refs[0].error("this server decodes no audio.", "audio_unsupported")


class GenerationEndpoint(ModelEndpoint, Generic[RequestT]):
    """The endpoint of an API's generation route: one skeleton for every API.

    Runs on the event loop: :meth:`handle` parses the body (the slice's
    :meth:`parse`), checks it against the model it names (its
    :attr:`serving`, before any wait for the gate), decodes its images,
    videos and audio off the loop (``load_images``; ``load_videos`` and
    ``load_audios``, which ``app.py`` sets where they are taken; audio as
    the model takes it: its rate, its longest file), generates, and writes
    the answer with the slice's :meth:`send_whole` or :meth:`send_stream`.

    Attributes:
        call_id: Makes a tool call's id, in the API's own form.
    """

    call_id: Callable[[], str]
    load_videos: LoadVideos = staticmethod(_no_videos)
    load_audios: LoadAudios = staticmethod(_no_audios)

    @abstractmethod
    def parse(self, body: bytes, images: list[str]) -> RequestT:
        """The request in ``body``; where each of its images is named, in
        prompt order, added to ``images``."""

    @property
    @abstractmethod
    def serving(self) -> Serving[RequestT]:
        """The slice's one place a request is checked against its model."""

    @abstractmethod
    async def send_whole(self, reply: Reply[RequestT]) -> None:
        """Write the whole answer, once the generation ended."""

    @abstractmethod
    async def send_stream(self, reply: Reply[RequestT]) -> None:
        """Write the answer as it is generated (the status with its first
        token, so a failed prefill is still an error status)."""

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = self.parse(body, images)
        log.stream = bool(request.stream)
        async with self.model(request.model, log) as (served, engine):
            capabilities = Capabilities.of(engine, served)
            prepared = await self.serving.prepare(request, capabilities)
            check_media(capabilities, prepared.images, prepared.videos, prepared.audios)
            decoded = await self.decode_images(prepared.images, log)
            params = prepared.params
            if prepared.videos:
                videos = await self.load_videos(prepared.videos)
                params = dataclasses.replace(params, videos=tuple(videos))
            taken = capabilities.audio_input
            if prepared.audios and taken is not None:  # check_media refused None
                audios = await self.load_audios(prepared.audios, taken)
                params = dataclasses.replace(params, audios=tuple(audios))
            async with self.generation(served, engine, params, decoded, log) as events:
                parser = answer_parser(capabilities, prepared, self.call_id)
                reply = Reply(
                    request, prepared, served.name, events, parser, response, log
                )
                if request.stream:
                    await self.send_stream(reply)
                else:
                    await self.send_whole(reply)


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
    """The parts of a token's ``text``: as parsed, else the text itself."""
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


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""
