"""``POST /v1/chat/completions``: validate, decode images, wait, generate, answer.

Event loop. The route of the chat-completions slice: the body is parsed
(:mod:`.protocol`), checked against the model once (:mod:`.serving`), the
generation runs through the model's gate and engine, and the answer is
written as OpenAI's (:mod:`.output`).

A plain ASGI endpoint rather than a Starlette request handler, so that one
``try``/``finally`` owns the request from its first byte to its last: the
model's turn and the stream on the MLX thread are always given back, whether
the request ends, fails, or the client goes away.

A status code is chosen only before the first byte of the response: prefill
runs before the response starts, so a bad request or a failed prefill is a
4xx/5xx, never a 200 that carries an error. A failure after a stream began is
sent as one error event, and the stream ends without ``[DONE]``.

Each request has one deadline (``request_timeout``) for everything after its
body was read: images, the wait for the model and the generation. Past it the
answer is a 504 (an error event if the stream began) and the generation is
closed on the MLX thread.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import anyio

from ...events import FinalEvent, TokenEvent
from ..answer import AnswerParser
from ..capabilities import Capabilities
from ..errors import (
    APIError,
    api_error,
    internal_error,
    thread_unavailable,
    timed_out,
)
from ..wire import (
    Disconnected,
    RequestLog,
    ResponseWriter,
    cancel_on_disconnect,
    read_body,
)
from .messages import image_parts
from .output import (
    Answer,
    content_choice,
    finish_reason,
    parsed_chunks,
    token_logprob,
    usage,
)
from .protocol import ChatCompletionRequest, parse_chat_request
from .responses import (
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkEncoder,
    Delta,
    ResponseMessage,
    TokenLogprob,
    completion_id,
)
from .serving import ChatCompletionsServing

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from mlx_pinned import MLXThread

    from ...config import ServerConfig
    from ...events import Engine, EventStream, LoadImages
    from ..metrics import ServerMetrics
    from ..models import ServedModel, ServedModels
    from ..residency import Residency
    from ..turns import LoopTurns

__all__ = ["ChatCompletionsEndpoint"]

logger = logging.getLogger("mlx_pinned.server")


class ChatCompletionsEndpoint:
    """The ASGI endpoint of ``POST /v1/chat/completions``.

    Runs on the event loop; the request is checked against its model in one
    place (:class:`.serving.ChatCompletionsServing`), images are decoded off
    the loop (``load_images``) and
    the generation runs on ``thread``, through the engine of the model the
    request names (held through ``residency``, which loads it first when it
    is loaded on first use), after a turn of that model's gate. A client
    that disconnects, while waiting or while generating, cancels its
    request: a generation that has not started never starts, a running one
    is closed on the MLX thread at its next token.
    """

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
        self.serving = ChatCompletionsServing(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = RequestLog(
            start=time.perf_counter(),
            client=_client(scope),
            route="POST /v1/chat/completions",
        )
        response = ResponseWriter(send)
        try:
            await self.turns.checkpoint()
            body = await read_body(scope, receive, self.config.max_body_bytes)
            timeout = self.config.request_timeout
            deadline = anyio.current_time() + timeout if timeout else math.inf
            # One scope: the deadline cancels it, and so does the watcher
            # when the client goes away (it marks the log first).
            with anyio.CancelScope(deadline=deadline) as limit:
                async with cancel_on_disconnect(receive, limit, response, log):
                    await self._answer(scope, body, response, log)
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
        self, scope: Scope, body: bytes, response: ResponseWriter, log: RequestLog
    ) -> None:
        """Handle the request; every error becomes an answer (none escapes)."""
        images: list[str] = []  # where the request's images are, once parsed
        try:
            await self._handle(scope, body, response, log, images)
        except Exception as exc:
            error = api_error(exc, retry_after=self.config.retry_after, images=images)
            if error is None:
                logger.exception("chat completion failed")
                error = internal_error()
            elif error.status == 500:  # the body names nothing: the log does
                logger.error("chat completion failed", exc_info=exc)
            await response.error(error)

    async def _handle(
        self,
        scope: Scope,
        body: bytes,
        response: ResponseWriter,
        log: RequestLog,
        images: list[str],
    ) -> None:
        if self.thread.closed:  # fail fast: nothing will ever run
            raise thread_unavailable()
        request = parse_chat_request(body)
        images.extend(param for param, _ in image_parts(request.messages))
        log.stream = bool(request.stream)
        served = self.models.get(request.model)
        log.model = served.name
        # Held until the generation is closed: the model is not unloaded
        # under it (and is loaded first, if it is loaded on first use).
        async with self.residency.use(served) as engine:
            await self._generate(request, served, engine, response, log)

    async def _generate(
        self,
        request: ChatCompletionRequest,
        served: ServedModel,
        engine: Engine,
        response: ResponseWriter,
        log: RequestLog,
    ) -> None:
        capabilities = Capabilities.of(engine, served)
        prepared = await self.serving.prepare(request, capabilities)
        params = prepared.params
        log.images = len(prepared.images)
        images = await self.load_images(prepared.images)
        arrived = time.perf_counter()
        async with served.gate.turn():
            log.queued = time.perf_counter() - arrived
            stream = engine.stream(params, images)
            parser = self.serving.answer_parser(request, capabilities, params)
            try:
                if request.stream:
                    await self._send_stream(
                        request, served.name, stream, response, log, parser
                    )
                else:
                    await self._send_whole(
                        request,
                        served.name,
                        stream,
                        response,
                        log,
                        params.max_tokens,
                        parser,
                    )
            finally:
                # Shielded: the close is queued on the MLX thread before the
                # slot is given back, even if we were cancelled, so (FIFO) it
                # runs before the next generation starts.
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    async def _send_whole(
        self,
        request: ChatCompletionRequest,
        name: str,
        stream: EventStream,
        response: ResponseWriter,
        log: RequestLog,
        max_tokens: int,
        parser: AnswerParser | None,
    ) -> None:
        """The whole answer as one JSON body, once the generation ended."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        final: FinalEvent | None = None
        # Taken in one batch (every token, then the final event): one
        # wake-up of the event loop per batch, not one per token.
        async for events in stream.batched(max_tokens + 1):
            await self.turns.checkpoint()
            for event in events:
                log.record(event, whole=True)
                text.append(event.text)
                if isinstance(event, TokenEvent) and event.logprobs is not None:
                    logprobs.append(token_logprob(event.logprobs))
                if isinstance(event, FinalEvent):
                    final = event
        assert final is not None, "a generation always ends with a FinalEvent"
        chunk_id, created = completion_id()
        if parser is None:
            message = ResponseMessage(content="".join(text))
            reason = finish_reason(final.finish_reason, calls=False)
        else:
            answer = Answer()
            answer.add(parser.feed("".join(text)))
            answer.add(parser.end(cut=final.finish_reason == "length"))
            answer.thought = parser.thought
            message = answer.message()
            reason = finish_reason(final.finish_reason, parser.called)
        choice = Choice(
            message=message,
            logprobs=ChoiceLogprobs(content=logprobs) if request.logprobs else None,
            finish_reason=reason,
        )
        completion = ChatCompletion(
            id=chunk_id,
            created=created,
            model=name,
            choices=[choice],
            usage=usage(final),
        )
        await response.json(completion.model_dump_json().encode())

    async def _send_stream(
        self,
        request: ChatCompletionRequest,
        name: str,
        stream: EventStream,
        response: ResponseWriter,
        log: RequestLog,
        parser: AnswerParser | None,
    ) -> None:
        """Server-sent events, a chunk per token; the status is sent with the
        first token, so a failed prefill is still an error status."""
        chunk_id, created = completion_id()
        chunks = ChunkEncoder(
            chunk_id, created, name, include_usage=request.include_usage
        )
        # Events that are ready together go out in one body message (each is
        # a write to the socket): the role chunk with the first token, and
        # the last chunks (finish, usage, [DONE]) with the end.
        role = chunks.chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
        async for event in stream:
            await self.turns.checkpoint()
            log.record(event)
            if isinstance(event, TokenEvent):
                if parser is not None:
                    data = parsed_chunks(chunks, parser.feed(event.text), event)
                elif event.logprobs is not None:
                    data = chunks.chunk([content_choice(event)])
                else:
                    data = chunks.content(event.text) if event.text else b""
                if not response.started:
                    await response.start_stream(role + data)
                elif data:
                    await response.send(data)
                continue
            if parser is None:
                tail = [chunks.content(event.text)] if event.text else []
                reason = finish_reason(event.finish_reason, calls=False)
            else:
                cut = event.finish_reason == "length"
                parts = [*parser.feed(event.text), *parser.end(cut=cut)]
                tail = [parsed_chunks(chunks, parts)]
                reason = finish_reason(event.finish_reason, parser.called)
            done = ChunkChoice(delta=Delta(), finish_reason=reason)
            tail.append(chunks.chunk([done]))
            if request.include_usage:
                tail.append(chunks.chunk([], usage(event)))
            tail.append(b"data: [DONE]\n\n")
            if not response.started:
                await response.start_stream(role)
            await response.send(b"".join(tail), more=False)
        await response.end()


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""
