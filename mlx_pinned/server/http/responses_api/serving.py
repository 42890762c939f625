"""The Responses API's one validation site: a parsed request checked against
the served model's :class:`~..capabilities.Capabilities`, this server's
limits and the stored responses, and turned into the shared generation
request.

Event loop; a grammar is checked in a worker thread (:mod:`..structured`).
Here, once, before the request waits for the model's gate: the stored
response it continues (``previous_response_id``), its text against the
prompt limit, ``max_output_tokens`` against the server's limit, tools
against the model's tool-call format, the grammar (``text.format`` or a
forced call), its images (how many, and whether the model takes any).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...events import GenerationParams, Grammar
from ...formats import ToolCallFormat, ToolSpec, json_arguments
from ...media import ImageRef
from ..answer import AnswerParser, answer_parser
from ..errors import APIError
from ..serving_common import (
    check_images,
    check_max_tokens,
    check_prompt_text,
    forced_call_grammar,
    no_tool_call_format,
    unforced_call,
)
from ..structured import check_grammar
from ..thinking import with_budget
from .items import (
    MessageItem,
    NamedFunctionChoice,
    chat_messages,
    image_urls,
    text_chars,
)
from .objects import item_id, tool_call_id
from .protocol import JSONObjectFormat, JSONSchemaFormat

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ..capabilities import Capabilities
    from .protocol import ResponsesRequest
    from .store import ResponseStore

__all__ = ["Prepared", "ResponsesServing", "request_grammar"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request checked against its model and the store.

    Attributes:
        params: The shared generation request.
        images: Every image of the conversation in prompt order, to decode.
        history: The conversation without instructions (a stored response's
            turns, then this request's input), to store with the answer.
        input_items: This request's input items, with ids, to store.
    """

    params: GenerationParams
    images: list[ImageRef]
    history: tuple[dict[str, Any], ...]
    input_items: list[dict[str, Any]]


class ResponsesServing:
    """Checks Responses requests against the served model, the server's
    limits (``config``) and the stored responses (``store``)."""

    def __init__(self, config: ServerConfig, store: ResponseStore) -> None:
        self.config = config
        self.store = store

    async def prepare(
        self, request: ResponsesRequest, capabilities: Capabilities
    ) -> Prepared:
        """Check ``request``; its generation request.

        Raises:
            APIError: 400 naming the parameter at fault; 404 for a
                ``previous_response_id`` not stored.
            PromptTooLongError: Its text alone is over the prompt limit.
            ImageRefusedError: Too many images.
            ImagesUnsupportedError: Images, and the model takes none.
        """
        before: tuple[dict[str, Any], ...] = ()
        urls: list[str] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
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
        context = capabilities.context_length
        max_prompt = check_prompt_text(self.config, capabilities, text_chars(messages))
        tool_format = capabilities.formats.tool_call
        if request.active_tools and tool_format is None:
            raise no_tool_call_format("function tools")
        params = request.to_generation_params(
            messages,
            self.max_tokens(request),
            max_prompt_tokens=max_prompt,
            context_length=context,
            grammar=await request_grammar(request, tool_format),
        )
        params = with_budget(
            params, capabilities, request.template_kwargs, request.thinking_budget
        )
        urls += [url for _, url in image_urls(items)]
        refs = [ImageRef(index, url) for index, url in enumerate(urls)]
        limits = self.config.image_limits
        if len(refs) > limits.max_images:
            raise refs[limits.max_images].error(
                f"too many images: {len(refs)} in this conversation, at most "
                f"{limits.max_images} are allowed.",
                "too_many_images",
            )
        check_images(
            refs,
            capabilities,
            "this model takes no images; send text parts only.",
            "images_unsupported",
        )
        return Prepared(params, refs, history, _input_items(items))

    def max_tokens(self, request: ResponsesRequest) -> int:
        """``max_output_tokens``, else the server's default.

        Raises:
            APIError: 400 over the server's ``max_tokens_limit``.
        """
        asked = request.max_output_tokens
        if asked is None:
            return self.config.default_max_tokens
        return check_max_tokens(
            "max_output_tokens", asked, self.config.max_tokens_limit
        )

    def answer_parser(
        self,
        request: ResponsesRequest,
        capabilities: Capabilities,
        params: GenerationParams,
    ) -> AnswerParser | None:
        """The parser of the request's answer; None when its text is its
        content."""
        return answer_parser(
            capabilities,
            template_kwargs=request.template_kwargs,
            tools=[
                ToolSpec(tool.name, tool.parameters) for tool in request.active_tools
            ],
            constrained=params.grammar is not None,
            call_id=tool_call_id,
        )


async def request_grammar(
    request: ResponsesRequest, tool_format: ToolCallFormat | None
) -> Grammar | None:
    """The grammar the answer must follow, checked; None if free.

    ``text.format`` ``json_object`` or ``json_schema``; ``tool_choice``
    ``required`` (one call, or with ``parallel_tool_calls`` not false, one or
    more) or a named function (exactly one call to it), in the model's
    ``tool_format``.

    Raises:
        APIError: 400 naming the schema that cannot be used, or the format
            that cannot force a call to the tools.
    """
    choice = request.tool_choice
    named = isinstance(choice, NamedFunctionChoice)
    functions = request.function_tools
    if tool_format is not None and functions and (choice == "required" or named):
        chosen = functions
        if isinstance(choice, NamedFunctionChoice):
            chosen = [tool for tool in functions if tool.name == choice.name]
        for tool in chosen:
            if tool.parameters is not None:
                schema = json.dumps(json_arguments(tool.parameters))
                index = (request.tools or []).index(tool)
                await check_grammar(
                    Grammar("json_schema", schema), f"tools[{index}].parameters"
                )
        specs = [ToolSpec(tool.name, tool.parameters) for tool in chosen]
        parallel = not named and request.parallel_tool_calls is not False
        return await forced_call_grammar(tool_format, specs, parallel, unforced_call)
    wanted = request.text.format if request.text is not None else None
    if isinstance(wanted, JSONObjectFormat):
        return Grammar("json_object")
    if isinstance(wanted, JSONSchemaFormat):
        grammar = Grammar("json_schema", json.dumps(wanted.json_schema))
        await check_grammar(grammar, "text.format")
        return grammar
    return None


def _input_items(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them: each with an id, a string
    message's text as one ``input_text`` part."""
    out = []
    for item in items:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": item.content}]
        if isinstance(item, MessageItem):
            data["status"] = "completed"
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}
        out.append({"id": item_id(prefix.get(item.type, "fco")), **data})
    return out
