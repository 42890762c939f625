"""The Responses API's objects: ids, the response object, its output items
as the answer's parts build them, and the stream's events, which rebuild
exactly the whole response. Event loop (pure CPU, plain dicts)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ...formats import CallArguments, CallStart
from ..answer_parser import Part, Reasoning
from ..wire import random_hex, sse_event

if TYPE_CHECKING:
    from ...events import FinalEvent
    from .protocol import ResponsesRequest

__all__ = [
    "Output",
    "item_id",
    "replayed",
    "response_object",
    "sse",
    "tool_call_id",
    "usage",
]


def item_id(prefix: str) -> str:
    return f"{prefix}_{random_hex(128)}"


def tool_call_id() -> str:
    return item_id("call")


def sse(event: dict[str, Any]) -> bytes:
    return sse_event(event, event=event["type"])


def usage(final: FinalEvent) -> dict[str, Any]:
    """``cache_write_tokens`` is 0: the prompt cache keeps prefixes on its
    own, with no write of its own to count (docs/responses.md)."""
    details = {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0}
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def response_object(
    request: ResponsesRequest, response_id: str, created: int, model: str
) -> dict[str, Any]:
    """The response object, in progress and with no output yet (and no
    ``usage``); the request's settings echoed as OpenAI echoes them."""
    text = request.text.format if request.text is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if text is not None:
        text_format = text.model_dump(mode="json", by_alias=True, exclude_none=True)
    choice = request.tool_choice
    reasoning = request.reasoning
    head: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "service_tier": "default",
        "store": request.store is not False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": {"format": text_format, "verbosity": "medium"},
        "tool_choice": (
            choice.model_dump(mode="json")
            if choice is not None and not isinstance(choice, str)
            else choice or "auto"
        ),
        "tools": [tool.echo() for tool in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": "disabled",
        "metadata": request.metadata or {},
    }
    if request.user is not None:
        head["user"] = request.user
    if request.prompt_cache_options is not None:
        head["prompt_cache_options"] = {"ttl": "30m", "mode": "implicit"}
    return head


def replayed(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream of events of a stored ``response``, as its ``POST`` would
    have streamed it (each text in one delta)."""
    output = Output()
    head = {**response, "status": "in_progress", "output": []}
    head["incomplete_details"] = None
    head.pop("usage", None)
    events = [
        output.event("response.created", response=head),
        output.event("response.in_progress", response=head),
    ]
    for item in response["output"]:
        events += output.replay(item)
    kind = "completed" if response["status"] == "completed" else "incomplete"
    return [*events, output.event(f"response.{kind}", response=response)]


class Output:
    """The output items of one answer, built part by part; :meth:`add`
    returns the stream events the parts make, numbered from ``sequence``."""

    def __init__(self, sequence: int = 0) -> None:
        self.sequence = sequence
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def add(self, parts: list[Part]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, Reasoning):
                events += self._text("reasoning", "reasoning_text", part.text)
            elif isinstance(part, str):
                if part:
                    events += self._text("message", "output_text", part)
            elif isinstance(part, CallStart):
                events += self.close()
                item = {
                    "id": item_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "arguments": "",
                    "call_id": part.id,
                    "name": part.name,
                }
                self._calls[part.index] = item
                events += self._begin(item)
            else:
                item = self._calls[part.index]
                item["arguments"] += part.text
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=part.text,
                    )
                )
        return events

    def replay(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that make a stored output ``item``, as its answer's
        stream made them (its text or arguments in one delta)."""
        if item["type"] == "function_call":
            fresh = {**item, "status": "in_progress", "arguments": ""}
            index = len(self._calls)
            self._calls[index] = fresh
            events = self._begin(fresh)
            events += self.add([CallArguments(index, item["arguments"])])
        else:
            fresh = {**item, "content": []}
            if "status" in item:
                fresh["status"] = "in_progress"
            events = self._begin(fresh)
            part_kind = "output_text" if item["type"] == "message" else "reasoning_text"
            events += self._text(item["type"], part_kind, item["content"][0]["text"])
        return events + self.close(item.get("status", "completed"))

    def add_empty_message(self) -> list[dict[str, Any]]:
        """The output of an answer with no text at all."""
        return self._text("message", "output_text", "")

    def _begin(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        added = self.event(
            "response.output_item.added",
            output_index=len(self.items) - 1,
            item=json.loads(json.dumps(item)),
        )
        if item["type"] == "function_call":
            return [added]
        kind = "output_text" if item["type"] == "message" else "reasoning_text"
        part: dict[str, Any] = {"type": kind, "text": ""}
        if kind == "output_text":
            part.update(annotations=[], logprobs=[])
        item["content"].append(part)
        return [
            added,
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                part=dict(part),
            ),
        ]

    def _text(self, kind: str, part_kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            item: dict[str, Any] = {"id": item_id("msg" if kind == "message" else "rs")}
            if kind == "message":
                item.update(type="message", status="in_progress", content=[])
                item["role"] = "assistant"
            else:
                item.update(type="reasoning", summary=[], content=[])
            events += self._begin(item)
        assert self._open is not None
        self._open["content"][0]["text"] += text
        fields: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(
                f"response.{part_kind}.delta",
                item_id=self._open["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **fields,
            )
        )
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item; ``incomplete``: it was cut (the answer's
        length ran out)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] != "reasoning" or status != "completed":
            item["status"] = status
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            kind = part["type"]
            fields: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events += [
                self.event(f"response.{kind}.done", **ids, text=part["text"], **fields),
                self.event("response.content_part.done", **ids, part=dict(part)),
            ]
        events.append(
            self.event(
                "response.output_item.done",
                output_index=index,
                item=json.loads(json.dumps(item)),
            )
        )
        return events
