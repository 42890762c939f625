"""``POST /v1/chat/completions``: parse, check, decode images, generate, answer.

Event loop. The route of the chat-completions slice: the body is parsed
(:mod:`.protocol`), checked against the model once (:mod:`.serving`), the
generation runs through the model's gate and engine
(:class:`~..endpoint.GenerationEndpoint`: the deadline, the client watched,
every error answered in OpenAI's shape), and the answer is written as
OpenAI's (:mod:`.output`): one JSON body, or a chunk per token that ends
with ``data: [DONE]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from ...events import TokenEvent
from ..answer import AnswerParser
from ..capabilities import Capabilities
from ..endpoint import GenerationEndpoint, last_parts, send_last
from ..wire import (
    RequestLog,
    ResponseWriter,
)
from .messages import image_parts, video_parts
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
    completion_id,
)
from .serving import ChatCompletionsServing

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ...events import EventStream
    from ...media import LoadVideos, Video, VideoRef

__all__ = ["ChatCompletionsEndpoint"]


async def _no_videos(refs: Sequence[VideoRef]) -> list[Video]:
    raise refs[0].error("this server decodes no videos.", "videos_unsupported")


class ChatCompletionsEndpoint(GenerationEndpoint):
    """The ASGI endpoint of ``POST /v1/chat/completions``.

    Runs on the event loop (the rest is :class:`~..endpoint.GenerationEndpoint`'s):
    the request is checked against its model in one place
    (:class:`.serving.ChatCompletionsServing`), its images and videos are
    decoded off the loop (``load_images``; ``load_videos``, which ``app.py``
    sets), and the answer is written as OpenAI's.
    """

    route = "POST /v1/chat/completions"
    load_videos: LoadVideos = staticmethod(_no_videos)

    @functools.cached_property
    def serving(self) -> ChatCompletionsServing:
        """The one place a request is checked against its model."""
        return ChatCompletionsServing(self.config)

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_chat_request(body)
        images.extend(param for param, _ in image_parts(request.messages))
        images.extend(param for param, _ in video_parts(request.messages))
        log.stream = bool(request.stream)
        async with self.model(request.model, log) as (served, engine):
            capabilities = Capabilities.of(engine, served)
            prepared = await self.serving.prepare(request, capabilities)
            params = prepared.params
            decoded = await self.decode_images(prepared.images, log)
            if prepared.videos:
                videos = await self.load_videos(prepared.videos)
                params = dataclasses.replace(params, videos=tuple(videos))
            async with self.generation(served, engine, params, decoded, log) as stream:
                parser = self.serving.answer_parser(request, capabilities, params)
                if request.stream:
                    await self._send_stream(
                        request, served.name, stream, response, log, parser
                    )
                else:
                    whole = self._whole(
                        request, served.name, stream, log, params.max_tokens, parser
                    )
                    await response.json(await whole)

    async def _whole(
        self,
        request: ChatCompletionRequest,
        name: str,
        stream: EventStream,
        log: RequestLog,
        max_tokens: int,
        parser: AnswerParser | None,
    ) -> bytes:
        """The whole answer as one JSON body, once the generation ended."""
        events, final = await self.whole(stream, log)
        text = "".join(event.text for event in events)
        logprobs = [
            token_logprob(event.logprobs)
            for event in events
            if isinstance(event, TokenEvent) and event.logprobs is not None
        ]
        chunk_id, created = completion_id()
        if parser is None:
            message = ResponseMessage(content=text)
            reason = finish_reason(final.finish_reason, calls=False)
        else:
            answer = Answer()
            answer.add(last_parts(parser, text, final))
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
        return completion.model_dump_json().encode()

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

        def encode(event: TokenEvent) -> bytes:
            if parser is not None:
                return parsed_chunks(chunks, parser.feed(event.text), event)
            if event.logprobs is not None:
                return chunks.chunk([content_choice(event)])
            return chunks.content(event.text) if event.text else b""

        final = await self.stream_tokens(stream, response, log, role, encode)
        if parser is None:
            tail = [chunks.content(final.text)] if final.text else []
            reason = finish_reason(final.finish_reason, calls=False)
        else:
            tail = [parsed_chunks(chunks, last_parts(parser, final.text, final))]
            reason = finish_reason(final.finish_reason, parser.called)
        done = ChunkChoice(delta=Delta(), finish_reason=reason)
        tail.append(chunks.chunk([done]))
        if request.include_usage:
            tail.append(chunks.chunk([], usage(final)))
        tail.append(b"data: [DONE]\n\n")
        await send_last(response, role, b"".join(tail))
