"""``POST /v1/completions``: the legacy completions door, a choice per
prompt. Event loop only."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import TypeAlias

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...events import Engine, Event, FinalEvent, GenerationParams
from ..door import Call, Door
from ..errors import completion_stream_failed
from ..generation import charge_of, generation
from ..vllm_extensions import VLLMPromptLogprobs, vllm_prompt_logprobs
from ..wire import RequestLog
from .output import (
    ChoiceText,
    ChunkWriter,
    Completion,
    CompletionChoice,
    Usage,
    completion_id,
    usage,
)
from .protocol import CompletionRequest, parse_completion_request
from .serving import CompletionsServing, Prompts

__all__ = ["CompletionsEndpoint"]

#: What a choice's task hands the answer: its index and a batch of its
#: events, or the error that ended it.
_Item: TypeAlias = tuple[int, tuple[Event, ...] | Exception]
_Items: TypeAlias = MemoryObjectReceiveStream[_Item]
_Call: TypeAlias = Call[CompletionRequest, Engine, Prompts]


class CompletionsEndpoint(Door[CompletionRequest, Engine, Prompts, _Items]):
    """Its run is a fan-out: each prompt is generated in a task of its own,
    which takes its own turn of the gate (so it never holds a turn while
    waiting for another); their events meet in one channel."""

    route = "POST /v1/completions"
    api = "completions"
    prompt = "prompt"
    gated = False  # each prompt takes its own turn

    @functools.cached_property
    def serving(self) -> CompletionsServing:
        return CompletionsServing(self.config)

    def streamed(self, request: CompletionRequest) -> bool:
        return bool(request.stream)

    async def parse(self, body: bytes, places: list[str]) -> CompletionRequest:
        return parse_completion_request(body)

    async def prepare(self, request: CompletionRequest, engine: Engine) -> Prompts:
        return await self.serving.prepare(request, engine.facts, engine)

    @asynccontextmanager
    async def run(self, call: _Call) -> AsyncIterator[_Items]:
        """The first error of any prompt, or of the writer, ends them all and
        is raised as it is."""
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        failed: list[Exception] = []
        async with anyio.create_task_group() as group:
            with send:
                for index, one in enumerate(call.prepared.params):
                    group.start_soon(self._generate_one, index, call, one, send.clone())
            try:
                with receive:
                    yield receive
            except Exception as exc:  # raised below, outside the task group
                failed.append(exc)
            group.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _generate_one(
        self,
        index: int,
        call: _Call,
        params: GenerationParams,
        send: MemoryObjectSendStream[_Item],
    ) -> None:
        with send:
            try:
                arrived = time.perf_counter()
                priced = charge_of(call.engine, params, ())
                async with call.served.gate.turn(params.priority, priced):
                    call.log.queued = time.perf_counter() - arrived
                    async with generation(call.engine, params, ()) as events:
                        if not call.log.stream:  # each answer whole
                            async for batch in events.batched(None):
                                await send.send((index, batch))
                            return
                        interval = self.config.stream_write_interval
                        async with aclosing(events.flowing(interval)) as flowing:
                            async for batch in flowing:
                                await send.send((index, batch))
            except Exception as exc:  # the answer raises it
                await send.send((index, exc))

    def _choices(self, call: _Call) -> list[ChoiceText]:
        request = call.request
        echo_top = request.logprobs if request.echo else None
        logprobs = request.logprobs is not None
        return [ChoiceText(logprobs, echo_top) for _ in call.prepared.params]

    async def send_whole(self, call: _Call, output: _Items) -> None:
        request, log = call.request, call.log
        choices = self._choices(call)
        async for index, batch in output:
            await self.wiring.turns.checkpoint()
            for event in _events(batch):
                log.record(event, whole=True)
                choices[index].add(event)
        chunk_id, created = completion_id()
        total = _counted(log, choices)
        echoes = call.prepared.echoes
        completion = Completion(
            id=chunk_id,
            created=created,
            model=call.served.name,
            choices=[
                CompletionChoice.ending(
                    index,
                    echo + "".join(choice.text),
                    choice.final,
                    choice.whole(),
                    _prompt_logprobs(request, choice.final),
                )
                for index, (choice, echo) in enumerate(
                    zip(choices, echoes, strict=True)
                )
            ],
            usage=total,
        )
        await call.response.json(completion.model_dump_json().encode())

    async def send_stream(self, call: _Call, output: _Items) -> None:
        """The status goes with the first token of any choice, so a prompt
        refused before it is an error status."""
        request, response, log = call.request, call.response, call.log
        choices = self._choices(call)
        chunk_id, created = completion_id()
        writer = ChunkWriter(
            chunk_id, created, call.served.name, include_usage=request.include_usage
        )
        # Echoed prompts go out with the first token, not before it.
        data = [
            writer.chunk(i, echo) for i, echo in enumerate(call.prepared.echoes) if echo
        ]
        async for index, batch in output:
            await self.wiring.turns.checkpoint()
            data += _chunks(writer, choices, index, batch, log)
            if not response.started:
                await response.start_stream(
                    b"".join(data), failed=completion_stream_failed
                )
            elif data:
                await response.send(b"".join(data))
            data = []
        total = _counted(log, choices)
        if request.include_usage:
            data.append(writer.usage(total))
        data.append(b"data: [DONE]\n\n")
        await response.send(b"".join(data), more=False)


def _chunks(
    writer: ChunkWriter,
    choices: list[ChoiceText],
    index: int,
    batch: tuple[Event, ...] | Exception,
    log: RequestLog,
) -> list[bytes]:
    out = []
    for event in _events(batch):
        log.record(event)
        text, logprobs = choices[index].add(event)
        if isinstance(event, FinalEvent):
            out.append(writer.chunk(index, text, None, event))
        elif text or logprobs is not None:
            out.append(writer.chunk(index, text, logprobs))
    return out


def _counted(log: RequestLog, choices: list[ChoiceText]) -> Usage:
    total = usage([c.final for c in choices if c.final is not None])
    log.prompt_tokens = total.prompt_tokens
    log.completion_tokens = total.completion_tokens
    return total


def _prompt_logprobs(
    request: CompletionRequest, final: FinalEvent | None
) -> VLLMPromptLogprobs | None:
    top = request.prompt_logprobs
    if top is None or final is None:
        return None
    return vllm_prompt_logprobs(final.prompt_logprobs, top)


def _events(batch: tuple[Event, ...] | Exception) -> tuple[Event, ...]:
    if isinstance(batch, Exception):
        raise batch
    return batch
