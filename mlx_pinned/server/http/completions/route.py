"""``POST /v1/completions``: parse, check, generate every prompt, answer.

Event loop. The route of the legacy completions slice: the body is parsed
(:mod:`.protocol`), checked against the model once (:mod:`.serving`), and
each prompt is generated as its own row of the batch, in a task of its own
that takes its own turn of the model's gate (so a request with more prompts
than the batch has rows waits for turns as other requests do, and never
holds a turn while waiting for another). Their events meet in one channel,
and the answer is written as OpenAI's (:mod:`.output`): one JSON body with a
choice per prompt, or ``text_completion`` chunks, each naming its choice's
``index``, that end with ``data: [DONE]``. The stream's status is sent with
the first token of any choice, so a prompt refused in prefill before it is
still an error status.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, TypeAlias

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...events import Event, FinalEvent
from ..endpoint import ModelEndpoint
from ..errors import APIError, api_error
from ..slots import Capabilities
from ..vllm_extensions import VLLMPromptLogprobs, vllm_prompt_logprobs
from .output import (
    ChoiceText,
    ChunkWriter,
    Completion,
    CompletionChoice,
    completion_id,
    usage,
)
from .protocol import CompletionRequest, parse_completion_request
from .serving import CompletionsServing

if TYPE_CHECKING:
    from ...events import Engine, GenerationParams
    from ..served_models import ServedModel
    from ..wire import RequestLog, ResponseWriter

__all__ = ["CompletionsEndpoint"]

#: What a choice's task hands the answer: its index and a batch of its
#: events, or the error that ended it.
_Item: TypeAlias = tuple[int, tuple[Event, ...] | Exception]
_Consume: TypeAlias = Callable[[MemoryObjectReceiveStream[_Item]], Awaitable[None]]


class CompletionsEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /v1/completions``.

    Runs on the event loop (the rest is :class:`~..endpoint.ModelEndpoint`'s).
    A failure of the prompt (too long, no tokens) names ``prompt``.
    """

    route = "POST /v1/completions"

    @functools.cached_property
    def serving(self) -> CompletionsServing:
        """The one place a request is checked against its model."""
        return CompletionsServing(self.config)

    def error_for(self, exc: BaseException, images: Sequence[str]) -> APIError | None:
        retry_after = self.config.retry_after
        return api_error(exc, retry_after=retry_after, images=images, prompt="prompt")

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_completion_request(body)
        log.stream = bool(request.stream)
        async with self.model(request.model, log) as (served, engine):
            capabilities = Capabilities.of(engine, served)
            prepared = await self.serving.prepare(request, capabilities, engine)
            logprobs = request.logprobs is not None
            echo_top = request.logprobs if request.echo else None
            choices = [ChoiceText(logprobs, echo_top) for _ in prepared.params]
            chunk_id, created = completion_id()
            writer = ChunkWriter(
                chunk_id, created, served.name, include_usage=request.include_usage
            )

            async def whole(items: MemoryObjectReceiveStream[_Item]) -> None:
                async for index, batch in items:
                    await self.turns.checkpoint()
                    for event in _events(batch):
                        log.record(event, whole=True)
                        choices[index].add(event)

            async def stream(items: MemoryObjectReceiveStream[_Item]) -> None:
                # Echoed prompts go out with the first token, not before it.
                data = [
                    writer.chunk(i, echo)
                    for i, echo in enumerate(prepared.echoes)
                    if echo
                ]
                async for index, batch in items:
                    await self.turns.checkpoint()
                    data += self._chunks(writer, choices, index, batch, log)
                    if not response.started:
                        await response.start_stream(b"".join(data))
                    elif data:
                        await response.send(b"".join(data))
                    data = []
                finals = [c.final for c in choices if c.final is not None]
                if request.include_usage:
                    data.append(writer.usage(usage(finals)))
                data.append(b"data: [DONE]\n\n")
                await response.send(b"".join(data), more=False)

            await self._generate_all(
                served,
                engine,
                prepared.params,
                log,
                stream if request.stream else whole,
                streamed=bool(request.stream),
            )
            finals = [c.final for c in choices if c.final is not None]
            total = usage(finals)
            log.prompt_tokens = total.prompt_tokens
            log.completion_tokens = total.completion_tokens
            if request.stream:
                await response.end()
                return
            completion = Completion(
                id=chunk_id,
                created=created,
                model=served.name,
                choices=[
                    CompletionChoice.ending(
                        index,
                        echo + "".join(choice.text),
                        choice.final,
                        choice.whole(),
                        _prompt_logprobs(request, choice.final),
                    )
                    for index, (choice, echo) in enumerate(
                        zip(choices, prepared.echoes, strict=True)
                    )
                ],
                usage=total,
            )
            await response.json(completion.model_dump_json().encode())

    @staticmethod
    def _chunks(
        writer: ChunkWriter,
        choices: list[ChoiceText],
        index: int,
        batch: tuple[Event, ...] | Exception,
        log: RequestLog,
    ) -> list[bytes]:
        """The chunks of a batch of one choice's events."""
        out = []
        for event in _events(batch):
            log.record(event)
            text, logprobs = choices[index].add(event)
            if isinstance(event, FinalEvent):
                out.append(writer.chunk(index, text, None, event))
            elif text or logprobs is not None:
                out.append(writer.chunk(index, text, logprobs))
        return out

    async def _generate_all(
        self,
        served: ServedModel,
        engine: Engine,
        params: list[GenerationParams],
        log: RequestLog,
        consume: _Consume,
        *,
        streamed: bool,
    ) -> None:
        """Generate every prompt, each in its own task and row; ``consume``
        reads their events as they come (``streamed``: as they flow, else
        each answer whole). The first error of any prompt (or of
        ``consume``) ends them all and is raised as it is."""
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        failed: list[Exception] = []
        async with anyio.create_task_group() as group:
            with send:
                for index, one in enumerate(params):
                    group.start_soon(
                        self._generate_one,
                        index,
                        served,
                        engine,
                        one,
                        log,
                        send.clone(),
                        streamed,
                    )
            try:
                with receive:
                    await consume(receive)
            except Exception as exc:  # raised below, outside the task group
                failed.append(exc)
            group.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _generate_one(
        self,
        index: int,
        served: ServedModel,
        engine: Engine,
        params: GenerationParams,
        log: RequestLog,
        send: MemoryObjectSendStream[_Item],
        streamed: bool,
    ) -> None:
        with send:
            try:
                async with self.generation(served, engine, params, (), log) as events:
                    if not streamed:  # each answer whole
                        async for batch in events.batched(None):
                            await send.send((index, batch))
                        return
                    interval = self.config.stream_write_interval
                    async with aclosing(events.flowing(interval)) as flowing:
                        async for batch in flowing:
                            await send.send((index, batch))
            except Exception as exc:  # the answer raises it
                await send.send((index, exc))


def _prompt_logprobs(
    request: CompletionRequest, final: FinalEvent | None
) -> VLLMPromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a choice, when asked for."""
    top = request.prompt_logprobs
    if top is None or final is None:
        return None
    return vllm_prompt_logprobs(final.prompt_logprobs, top)


def _events(batch: tuple[Event, ...] | Exception) -> tuple[Event, ...]:
    """A choice's batch of events; the error that ended it, raised."""
    if isinstance(batch, Exception):
        raise batch
    return batch
