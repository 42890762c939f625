"""``POST /v1/chat/completions``: validate, decode images, wait, generate, answer.

A plain ASGI endpoint rather than a Starlette request handler, so that one
``try``/``finally`` owns the request from its first byte to its last: the
model's turn and the stream on the MLX thread are always given back, whether
the request ends, fails, or the client goes away.

A status code is chosen only before the first byte of the response: prefill
runs before the response starts, so a bad request or a failed prefill is a
4xx/5xx, never a 200 that carries an error. A failure after a stream began is
sent as one error event, and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from mlx_pinned import (
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    StreamAffinityError,
)

from . import engine
from .engine import FinalEvent, GenerationParams, TokenEvent, TokenLogprobs
from .images import collect_image_refs, load_images
from .schemas import (
    APIError,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    completion_id,
    parse_chat_request,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from starlette.types import Message, Receive, Scope, Send

    from mlx_pinned import MLXThread

    from .app import ServerConfig, _Gate

logger = logging.getLogger("mlx_pinned.server")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass
class _Log:
    """What the one log line of a request reports."""

    start: float
    status: int = 0
    stream: bool = False
    images: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    finish: str = "-"
    disconnected: bool = False

    def record(self, event: TokenEvent | FinalEvent) -> None:
        if isinstance(event, TokenEvent):
            now = time.perf_counter()
            self.first_token = self.first_token or now
            self.last_token = now
            self.completion_tokens += 1
        else:
            self.prompt_tokens = event.prompt_tokens
            self.completion_tokens = event.completion_tokens
            self.finish = event.finish_reason

    def emit(self) -> None:
        end = time.perf_counter()
        ttft = (self.first_token - self.start) * 1e3 if self.first_token else 0.0
        decode = (self.last_token or end) - (self.first_token or end)
        rate = (self.completion_tokens - 1) / decode if decode > 0 else 0.0
        logger.info(
            "POST /v1/chat/completions %d stream=%s images=%d prompt=%d "
            "completion=%d queue=%.1fms ttft=%.1fms total=%.1fms %.1f tok/s "
            "finish=%s%s",
            self.status,
            int(self.stream),
            self.images,
            self.prompt_tokens,
            self.completion_tokens,
            self.queued * 1e3,
            ttft,
            (end - self.start) * 1e3,
            rate,
            self.finish,
            " (client disconnected)" if self.disconnected else "",
        )


def model_not_found(name: str, config: ServerConfig) -> APIError:
    """The 404 for a model this server does not serve."""
    return APIError(
        404,
        f"The model {name!r} does not exist: this server serves "
        f"{config.served_model_name!r}.",
        param="model",
        code="model_not_found",
    )


class _Disconnected(Exception):
    """The client left before its request body was read."""


class ChatEndpoint:
    """The ASGI endpoint of ``POST /v1/chat/completions``.

    Runs on the event loop; images are decoded in a worker thread and the
    generation runs on ``thread``. A client that disconnects, while waiting
    or while generating, cancels its request: a generation that has not
    started never starts, a running one is closed on the MLX thread at its
    next token.
    """

    def __init__(self, config: ServerConfig, thread: MLXThread, gate: _Gate) -> None:
        self.config = config
        self.thread = thread
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = _Log(start=time.perf_counter())
        response = _Response(send)
        try:
            body = await _read_body(scope, receive, self.config.max_body_bytes)
            async with anyio.create_task_group() as group:
                group.start_soon(
                    _watch_disconnect, receive, group.cancel_scope, response, log
                )
                try:
                    await self._answer(scope, body, response, log)
                finally:
                    group.cancel_scope.cancel()
        except _Disconnected:
            log.disconnected = True
        except APIError as error:
            await response.error(error)
        finally:
            log.status = response.status or (499 if log.disconnected else 0)
            log.emit()

    async def _answer(
        self, scope: Scope, body: bytes, response: _Response, log: _Log
    ) -> None:
        """Handle the request; every error becomes an answer (none escapes)."""
        try:
            await self._handle(scope, body, response, log)
        except APIError as error:
            await response.error(error)
        except (MLXThreadClosedError, MLXThreadBrokenError) as exc:
            await response.error(APIError(503, str(exc), code="mlx_thread_unavailable"))
        except MLXThreadBusyError as exc:
            await response.error(
                APIError(
                    503, str(exc), code="server_busy", headers={"Retry-After": "1"}
                )
            )
        except StreamAffinityError as exc:
            await response.error(APIError(500, str(exc), code="stream_affinity_error"))
        except Exception:
            logger.exception("chat completion failed")
            await response.error(
                APIError(500, "The server had an error while processing your request.")
            )

    async def _handle(
        self, scope: Scope, body: bytes, response: _Response, log: _Log
    ) -> None:
        request = parse_chat_request(body)
        log.stream = bool(request.stream)
        loaded = scope.get("state", {}).get("model")
        if loaded is None:
            raise APIError(503, "The model is not loaded yet; retry shortly.")
        if request.model != self.config.served_model_name:
            raise model_not_found(request.model, self.config)
        params = GenerationParams.from_request(request, self._max_tokens(request))
        vocab = loaded.vocab_size
        for token_id, _ in params.logit_bias:
            if token_id >= vocab:
                raise APIError(
                    400,
                    f"Invalid value for 'logit_bias': token id {token_id} is "
                    f"outside the vocabulary (0 to {vocab - 1}).",
                    param="logit_bias",
                    code="invalid_value",
                )
        refs = collect_image_refs(request.messages, self.config.image_limits)
        log.images = len(refs)
        images = await load_images(refs, self.config.image_limits)
        async with self.gate.turn():
            log.queued = time.perf_counter() - log.start
            stream = self.thread.iterate(engine.generate_stream, loaded, params, images)
            try:
                await self._respond(request, stream, response, log)
            finally:
                # Shielded: the next generation must not start before this one
                # is closed on the MLX thread, even if we were cancelled.
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    def _max_tokens(self, request: ChatCompletionRequest) -> int:
        asked = request.requested_max_tokens
        if asked is None:
            return self.config.default_max_tokens
        if asked > self.config.max_tokens_limit:
            name = (
                "max_completion_tokens"
                if request.max_completion_tokens is not None
                else "max_tokens"
            )
            raise APIError(
                400,
                f"Invalid value for '{name}': {asked} is more than this server's "
                f"limit of {self.config.max_tokens_limit} tokens.",
                param=name,
                code="invalid_value",
            )
        return asked

    async def _respond(
        self,
        request: ChatCompletionRequest,
        stream: AsyncIterator[TokenEvent | FinalEvent],
        response: _Response,
        log: _Log,
    ) -> None:
        chunk_id, created = completion_id()
        model = self.config.served_model_name
        if not request.stream:
            text: list[str] = []
            logprobs: list[TokenLogprob] = []
            final: FinalEvent | None = None
            async for event in stream:
                log.record(event)
                text.append(event.text)
                if isinstance(event, TokenEvent) and event.logprobs is not None:
                    logprobs.append(_token_logprob(event.logprobs))
                if isinstance(event, FinalEvent):
                    final = event
            assert final is not None, "a generation always ends with a FinalEvent"
            choice = Choice(
                message=ResponseMessage(content="".join(text)),
                logprobs=ChoiceLogprobs(content=logprobs) if request.logprobs else None,
                finish_reason=_finish(final),
            )
            completion = ChatCompletion(
                id=chunk_id,
                created=created,
                model=model,
                choices=[choice],
                usage=_usage(final),
            )
            await response.json(completion.model_dump_json().encode())
            return

        usage = request.include_usage

        def chunk(choices: list[ChunkChoice], final: FinalEvent | None = None) -> bytes:
            return ChatCompletionChunk(
                id=chunk_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(final) if final is not None else None,
            ).to_sse(include_usage=usage)

        # The first event (prefill) arrives before the response starts.
        role = ChunkChoice(delta=Delta(role="assistant", content=""))
        async for event in stream:
            log.record(event)
            if not response.started:
                await response.start_stream(chunk([role]))
            if isinstance(event, TokenEvent):
                if event.text or event.logprobs is not None:
                    await response.send(chunk([_content_choice(event)]))
                continue
            if event.text:
                await response.send(
                    chunk([ChunkChoice(delta=Delta(content=event.text))])
                )
            done = ChunkChoice(delta=Delta(), finish_reason=_finish(event))
            await response.send(chunk([done]))
            if usage:
                await response.send(chunk([], event))
            await response.send(b"data: [DONE]\n\n")
        await response.end()


def _finish(event: FinalEvent) -> Any:
    return "stop" if event.finish_reason == "stop" else "length"


def _usage(event: FinalEvent) -> Usage:
    return Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
    )


def _token_logprob(lp: TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(
        token=lp.token,
        logprob=lp.logprob,
        bytes=lp.bytes,
        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=b) for t, v, b in lp.top],
    )


def _content_choice(event: TokenEvent) -> ChunkChoice:
    logprobs = None
    if event.logprobs is not None:
        logprobs = ChoiceLogprobs(content=[_token_logprob(event.logprobs)])
    return ChunkChoice(delta=Delta(content=event.text), logprobs=logprobs)


class _Response:
    """The response side of one request: a status is sent once, first."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0
        self.started = False
        self.ended = False

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.started = status, True
        await self._send(
            {"type": "http.response.start", "status": status, "headers": headers}
        )

    async def json(
        self, body: bytes, status: int = 200, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        await self._start(status, [*_JSON_HEADERS, *extra])
        await self.send(body, more=False)

    async def start_stream(self, first: bytes) -> None:
        await self._start(200, _SSE_HEADERS)
        await self.send(first)

    async def send(self, body: bytes, *, more: bool = True) -> None:
        await self._send(
            {"type": "http.response.body", "body": body, "more_body": more}
        )
        self.ended = not more

    async def end(self) -> None:
        if self.started and not self.ended:
            await self.send(b"", more=False)

    async def error(self, error: APIError) -> None:
        """An error response, or an error event if the stream already began."""
        body = json.dumps(error.body()).encode()
        if error.status >= 500:
            logger.warning("answering %d: %s", error.status, error.message)
        try:
            if not self.started:
                headers = [
                    (k.lower().encode(), v.encode()) for k, v in error.headers.items()
                ]
                await self.json(body, error.status, headers)
            elif not self.ended:
                await self.send(b"data: " + body + b"\n\n", more=False)
        except OSError:  # the client is gone; nothing left to tell it
            pass


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit``."""
    too_large = APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise too_large
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _watch_disconnect(
    receive: Receive, scope: anyio.CancelScope, response: _Response, log: _Log
) -> None:
    """Cancel the request when its client disconnects before the answer ends."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not response.ended:
                log.disconnected = True
                scope.cancel()
            return
