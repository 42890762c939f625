"""The door of ``POST /v1/chat/completions``. Event loop only."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ...events import EventStream, TokenEvent
from ..errors import completion_stream_failed
from ..generation import Generation, GenerationDoor, last_parts, send_last
from ..vllm_extensions import vllm_prompt_logprobs
from ..wire import KEEP_ALIVE, Opening
from .bodies import (
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkEncoder,
    Delta,
    ResponseMessage,
    completion_id,
    tool_call_id,
)
from .messages import audio_parts, image_parts, video_parts
from .output import (
    Answer,
    content_choice,
    finish_reason,
    parsed_chunks,
    token_logprob,
    usage,
)
from .protocol import ChatCompletionRequest, parse_chat_request
from .serving import ChatCompletionsServing

__all__ = ["ChatCompletionsEndpoint"]


@dataclass(frozen=True)
class ChatOpening(Opening):
    chunks: ChunkEncoder = field(kw_only=True)


class ChatCompletionsEndpoint(GenerationDoor[ChatCompletionRequest]):
    route = "POST /v1/chat/completions"
    api = "chat_completions"
    call_id = staticmethod(tool_call_id)

    @functools.cached_property
    def serving(self) -> ChatCompletionsServing:
        return ChatCompletionsServing(self.config)

    async def parse(self, body: bytes, places: list[str]) -> ChatCompletionRequest:
        request = parse_chat_request(body)
        places.extend(param for param, _ in image_parts(request.messages))
        places.extend(param for param, _ in video_parts(request.messages))
        places.extend(audio_parts(request.messages))
        return request

    async def send_whole(
        self, call: Generation[ChatCompletionRequest], output: EventStream
    ) -> None:
        request, parser = call.request, self.parser(call)
        events, final = await self.whole(output, call.log)
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
            stop_reason=final.stop_reason,
        )
        completion = ChatCompletion(
            id=chunk_id,
            created=created,
            model=call.served.name,
            choices=[choice],
            usage=usage(final, predicted=request.prediction is not None),
            prompt_logprobs=None
            if request.prompt_logprobs is None
            else vllm_prompt_logprobs(final.prompt_logprobs, request.prompt_logprobs),
        )
        await call.response.json(completion.model_dump_json().encode())

    def opening(self, call: Generation[ChatCompletionRequest]) -> ChatOpening:
        """The role chunk; an SSE comment as keep-alive."""
        chunk_id, created = completion_id()
        include_usage = call.request.include_usage
        chunks = ChunkEncoder(
            chunk_id, created, call.served.name, include_usage=include_usage
        )
        role = chunks.chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
        return ChatOpening(role, KEEP_ALIVE, completion_stream_failed, chunks=chunks)

    async def send_stream(
        self, call: Generation[ChatCompletionRequest], output: EventStream
    ) -> None:
        request, parser = call.request, self.parser(call)
        opening = call.opening or self.opening(call)
        assert isinstance(opening, ChatOpening)
        # Events that are ready together go out in one body message (each is
        # a write to the socket): the role chunk with the first token (unless
        # the stream began), and the last chunks (finish, usage, [DONE]) with
        # the end.
        chunks, role = opening.chunks, opening.head

        def encode(event: TokenEvent) -> bytes:
            if parser is not None:
                return parsed_chunks(chunks, parser.feed(event.text), event)
            if event.logprobs is not None:
                return chunks.chunk([content_choice(event)])
            return chunks.content(event.text) if event.text else b""

        final = await self.stream_tokens(
            output,
            call.response,
            call.log,
            role,
            encode,
            failed=completion_stream_failed,
            progress=chunks.progress if request.return_progress else None,
        )
        if parser is None:
            tail = [chunks.content(final.text)] if final.text else []
            reason = finish_reason(final.finish_reason, calls=False)
        else:
            tail = [parsed_chunks(chunks, last_parts(parser, final.text, final))]
            reason = finish_reason(final.finish_reason, parser.called)
        done = ChunkChoice(
            delta=Delta(), finish_reason=reason, stop_reason=final.stop_reason
        )
        tail.append(chunks.chunk([done]))
        if request.include_usage:
            predicted = request.prediction is not None
            tail.append(chunks.chunk([], usage(final, predicted=predicted)))
        tail.append(b"data: [DONE]\n\n")
        await send_last(call.response, role, b"".join(tail))
