"""Ollama's one check against the model: a parsed ``/api/chat`` or
``/api/generate`` request against the model's :class:`~...events.ChatFacts`
and this server's limits, before it waits for the gate, turned into the
shared generation request. Event loop; a grammar compiles in a worker thread."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ...events import GenerationParams, Grammar
from ...formats import ToolSpec
from ..errors import APIError
from ..protocol_common import EFFORT_BUDGETS, counted_image_refs
from ..serving_common import (
    Prepared,
    check_prompt_text,
    max_tokens,
    no_tool_call_format,
    request_grammar,
    with_budget,
)
from .protocol import ChatRequest, GenerateRequest, GenerationBody, Message

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ...events import ChatFacts

__all__ = ["OllamaServing", "image_places", "image_url"]

# What a base64 image starts with, by its format (Ollama sends no type).
_MAGIC = {"iVBORw0KGgo": "png", "/9j/": "jpeg", "R0lGOD": "gif", "UklGR": "webp"}


def image_url(data: str) -> str:
    """An Ollama image (bare base64) as the decoders take it: a data URI of
    the type its first bytes say (the decoder reads the bytes either way)."""
    kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), "png")
    return f"data:image/{kind};base64,{data}"


def image_places(request: ChatRequest | GenerateRequest) -> list[tuple[str, str]]:
    """Each image in prompt order: where it is in the request
    (``messages[1].images[0]``, ``images[0]``) and its base64."""
    if isinstance(request, GenerateRequest):
        return [(f"images[{j}]", data) for j, data in enumerate(request.images or ())]
    return [
        (f"messages[{i}].images[{j}]", data)
        for i, message in enumerate(request.messages)
        for j, data in enumerate(message.images or ())
    ]


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}", param=param)


def _turn(message: Message, index: int) -> dict[str, Any]:
    """A turn as mlx-vlm's chat messages: each image an ``image_url``
    marker before the text, as Ollama places them."""
    if message.images and message.role != "user":
        raise _invalid(f"messages[{index}].images", "only a user turn takes images.")
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images:
        markers = [{"type": "image_url"} for _ in message.images]
        turn["content"] = [*markers, {"type": "text", "text": message.content}]
    if message.tool_calls:
        turn["tool_calls"] = [
            {"type": "function", "function": call.function.model_dump()}
            for call in message.tool_calls
        ]
    if message.tool_name is not None:
        turn["name"] = message.tool_name
    return turn


class OllamaServing:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def prepare(
        self, request: ChatRequest | GenerateRequest, facts: ChatFacts
    ) -> Prepared:
        """Raises an ``APIError`` naming the field at fault, a
        ``PromptTooLongError`` for text alone over the prompt limit, or an
        ``ImageRefusedError`` for too many images."""
        options = request.options
        kwargs, budget = _thinking(request, facts)
        messages, prompt = self._prompt(request, facts, kwargs)
        max_prompt = check_prompt_text(self.config, facts, _chars(request))
        if options.num_ctx is not None:
            context = facts.context_length
            if context is not None and options.num_ctx > context:
                raise _invalid(
                    "options.num_ctx",
                    f"{options.num_ctx} is more than this model's context of "
                    f"{context} tokens.",
                )
            max_prompt = min(max_prompt or options.num_ctx, options.num_ctx)
        asked = options.num_predict
        if asked in (-1, -2):  # no limit, and the context's: what the context leaves
            asked = self.config.max_tokens_limit or facts.context_length
        most = max_tokens(self.config, "options.num_predict", asked)
        tools = request.tools if isinstance(request, ChatRequest) else None
        if tools and facts.formats.tool_call is None:
            raise no_tool_call_format(code=None)
        grammar = await request_grammar(None, None, _answer_format(request))
        params = GenerationParams(
            messages=tuple(messages),
            max_tokens=most,
            sampling=options.sampling(
                logprobs=request.logprobs, top_logprobs=request.top_logprobs
            ),
            stop=options.stops,
            max_prompt_tokens=max_prompt,
            context_length=facts.context_length,
            grammar=grammar,
            tools=tuple(tool.model_dump(exclude_none=True) for tool in tools or ()),
            template_kwargs=tuple(kwargs.items()),
            prompt=prompt,
        )
        params = with_budget(params, facts, kwargs, budget)
        urls = (image_url(data) for _, data in image_places(request))
        refs = counted_image_refs(urls, self.config.image_limits)
        specs = [ToolSpec(t.function.name, t.function.parameters) for t in tools or ()]
        return Prepared(params, refs, (), specs, kwargs)

    def _prompt(
        self,
        request: ChatRequest | GenerateRequest,
        facts: ChatFacts,
        kwargs: dict[str, Any],
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The chat's turns, or a raw prompt's text; the template's
        ``suffix`` into ``kwargs``."""
        if isinstance(request, ChatRequest):
            return [_turn(m, i) for i, m in enumerate(request.messages)], None
        template = facts.chat_template or ""
        if request.template and request.template != template:
            raise _invalid(
                "template",
                "this server renders prompts with the model's own chat template "
                "only (see /api/show); leave it out.",
            )
        if request.raw:
            for name in ("system", "images", "suffix"):
                if getattr(request, name):
                    raise _invalid(
                        name, "a raw prompt is sent as it is; put it in the prompt."
                    )
            return [], request.prompt
        if request.suffix:
            if "suffix" not in template:
                raise _invalid(
                    "suffix",
                    "this model's chat template takes no suffix (no fill in the "
                    "middle); leave it out.",
                )
            kwargs["suffix"] = request.suffix
        turns: list[dict[str, Any]] = []
        if request.system:
            turns.append({"role": "system", "content": request.system})
        user = Message(role="user", content=request.prompt, images=request.images)
        return [*turns, _turn(user, 0)], None


def _chars(request: ChatRequest | GenerateRequest) -> int:
    """Characters of text in the prompt, as every template writes them."""
    if isinstance(request, ChatRequest):
        return sum(len(message.content) for message in request.messages)
    texts = (request.prompt, request.system, request.suffix)
    return sum(len(text or "") for text in texts)


def _thinking(
    request: GenerationBody, facts: ChatFacts
) -> tuple[dict[str, Any], int | None]:
    """``think`` as the chat template's switches, and its level's thinking
    budget: a 400 where the model does not think, or takes no level."""
    think = request.think
    if think is None or think is False:
        return ({} if think is None else {"enable_thinking": False}), None
    reasoning = facts.formats.reasoning
    if reasoning is None or (isinstance(request, GenerateRequest) and request.raw):
        raise _invalid(
            "think",
            "this model does not think (no reasoning format in its chat template, "
            "or a raw prompt); send think false or leave it out.",
        )
    kwargs: dict[str, Any] = {"enable_thinking": True}
    if think is True:
        return kwargs, None
    template = facts.chat_template or ""
    if "reasoning_effort" in template:
        kwargs["reasoning_effort"] = think
    elif reasoning.budget_markers(template, kwargs) is None:
        raise _invalid(
            "think",
            f"this model cannot be given a level of thinking ({think!r}); send "
            "think true or false.",
        )
    return kwargs, EFFORT_BUDGETS[think]


def _answer_format(request: GenerationBody) -> tuple[str, Grammar] | None:
    answer = request.format
    if not answer:
        return None
    if answer == "json":
        return "format", Grammar("json_object")
    return "format", Grammar("json_schema", json.dumps(answer))
