"""The Responses API's one check against the model: a parsed request against
the model's :class:`~...events.ChatFacts`, this server's limits and the
stored response it continues, before it waits for the gate, turned into the
shared generation request. Event loop; a grammar compiles in a worker thread."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...events import Grammar
from ...formats import ToolSpec
from ...media import ImageRef
from ..errors import APIError
from ..serving_common import (
    ForcedCall,
    Prepared,
    check_prompt_text,
    max_tokens,
    no_tool_call_format,
    request_grammar,
    with_budget,
)
from .items import (
    FunctionCallOutputItem,
    ImageContent,
    MessageItem,
    NamedFunctionChoice,
    ReasoningItem,
    TextContent,
    chat_messages,
    image_urls,
    text_chars,
)
from .objects import item_id
from .protocol import JSONObjectFormat, JSONSchemaFormat
from .store import DamagedResponseError

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ...events import ChatFacts
    from .protocol import ResponsesRequest
    from .store import ResponseStore

__all__ = ["Continued", "ResponsesServing", "unreadable"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Continued(Prepared):
    """A request checked against its model and the store, with what is
    stored with its answer; its ``images`` are every image of the
    conversation, and ``history`` the conversation without instructions."""

    history: tuple[dict[str, Any], ...]
    input_items: list[dict[str, Any]]


class ResponsesServing:
    def __init__(self, config: ServerConfig, store: ResponseStore) -> None:
        self.config = config
        self.store = store

    async def prepare(self, request: ResponsesRequest, facts: ChatFacts) -> Continued:
        """Raises an ``APIError`` (a 404 for a ``previous_response_id`` not
        stored, a 500 for one that cannot be read), a ``PromptTooLongError``
        or an ``ImageRefusedError``."""
        before: tuple[dict[str, Any], ...] = ()
        urls: list[str] = []
        if request.previous_response_id is not None:
            try:
                stored = await self.store.get(request.previous_response_id)
            except DamagedResponseError as exc:
                raise unreadable(exc, "previous_response_id") from None
            if stored is None:
                raise APIError(
                    404,
                    f"Previous response with id '{request.previous_response_id}' "
                    "not found: it was never stored (store=false), was deleted, "
                    "or was evicted by the store's bound.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            before, urls = stored.messages, list(stored.images)
        items = request.items
        history = (*before, *chat_messages(items))
        system = (
            ()
            if request.instructions is None
            else ({"role": "system", "content": request.instructions},)
        )
        messages = (*system, *history)
        max_prompt = check_prompt_text(self.config, facts, text_chars(messages))
        tool_format = facts.formats.tool_call
        if request.active_tools and tool_format is None:
            raise no_tool_call_format("function tools")
        most = max_tokens(self.config, "max_output_tokens", request.max_output_tokens)
        grammar = await request_grammar(
            tool_format, _forced_call(request), _answer_format(request)
        )
        params = request.to_generation_params(
            messages,
            most,
            max_prompt_tokens=max_prompt,
            context_length=facts.context_length,
            grammar=grammar,
        )
        kwargs = request.template_kwargs
        params = with_budget(params, facts, kwargs, request.thinking_budget)
        urls += [url for _, url in image_urls(items)]
        refs = [ImageRef(index, url) for index, url in enumerate(urls)]
        limits = self.config.image_limits
        if len(refs) > limits.max_images:
            raise refs[limits.max_images].error(
                f"too many images: {len(refs)} in this conversation, at most "
                f"{limits.max_images} are allowed.",
                "too_many_images",
            )
        tools = [ToolSpec(tool.name, tool.parameters) for tool in request.active_tools]
        return Continued(
            params=params,
            images=refs,
            tools=tools,
            template_kwargs=kwargs,
            history=history,
            input_items=_input_items(items),
        )


def unreadable(exc: DamagedResponseError, param: str) -> APIError:
    """A 500 that is not retried (``x-should-retry: false``, which OpenAI's
    SDKs read): the stored copy stays damaged until it is deleted."""
    return APIError(
        500,
        f"Response '{exc.response_id}' is stored but cannot be read: its stored "
        f"copy is damaged. Delete it (DELETE /v1/responses/{exc.response_id}); "
        "the other stored responses are unaffected.",
        param=param,
        code="stored_response_damaged",
        headers={"x-should-retry": "false"},
    )


def _forced_call(request: ResponsesRequest) -> ForcedCall | None:
    choice = request.tool_choice
    named = isinstance(choice, NamedFunctionChoice)
    functions = request.function_tools
    if not functions or not (choice == "required" or named):
        return None
    tools = [
        (
            f"tools[{(request.tools or []).index(tool)}].parameters",
            ToolSpec(tool.name, tool.parameters),
        )
        for tool in functions
        if not isinstance(choice, NamedFunctionChoice) or tool.name == choice.name
    ]
    return ForcedCall(tools, not named and request.parallel_tool_calls is not False)


def _answer_format(request: ResponsesRequest) -> tuple[str, Grammar] | None:
    wanted = request.text.format if request.text is not None else None
    if isinstance(wanted, JSONObjectFormat):
        return "text.format", Grammar("json_object")
    if isinstance(wanted, JSONSchemaFormat):
        return "text.format", Grammar("json_schema", json.dumps(wanted.json_schema))
    return None


def _input_items(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them (OpenAI's ``ItemResource``):
    each with an id and a status; a message's parts of its role's kind (an
    assistant's ``output_text``, with its annotations)."""
    out = []
    for item in items:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem):
            data["content"] = [_part(part, item.role) for part in _parts(item)]
        if isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list):
            data["output"] = [_part(part, "tool") for part in item.output]
        if not isinstance(item, ReasoningItem):
            data["status"] = "completed"
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}
        out.append({"id": item_id(prefix.get(item.type, "fco")), **data})
    return out


def _parts(item: MessageItem) -> list[TextContent | ImageContent]:
    if isinstance(item.content, str):
        return [TextContent(type="input_text", text=item.content)]
    return list(item.content)


def _part(part: TextContent | ImageContent, role: str) -> dict[str, Any]:
    if isinstance(part, ImageContent):
        return {**part.model_dump(exclude_none=True), "detail": part.detail or "auto"}
    if part.type == "refusal":
        return {"type": "refusal", "refusal": part.refusal or part.text}
    if role != "assistant":
        return {"type": "input_text", "text": part.text}
    return {
        "type": "output_text",
        "text": part.text,
        "annotations": part.annotations or [],
        "logprobs": part.logprobs or [],
    }
