"""Anthropic Messages' one check against the model: a parsed request against
the model's :class:`~...events.ChatFacts` and this server's limits, before
it waits for the gate, turned into the shared generation request. Event
loop; a grammar compiles in a worker thread."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from ...events import Grammar
from ...formats import ToolSpec
from ..errors import APIError
from ..serving_common import (
    ForcedCall,
    Prepared,
    check_media,
    check_prompt_text,
    max_tokens,
    no_tool_call_format,
    request_grammar,
    with_budget,
)
from .content import image_refs, text_chars
from .protocol import (
    CountTokensRequest,
    MessagesRequest,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceTool,
)

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ...events import ChatFacts
    from ...media import ImageRef

__all__ = ["MessagesServing"]


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}", param=param)


def _with_turns(prepared: Prepared) -> Prepared:
    """``prepared``, refused if its chat has no turn at all (only empty
    system texts): a chat template has nothing to render."""
    if not prepared.params.messages:
        raise _invalid("messages", "no message has any content; send some text.")
    return prepared


class MessagesServing:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def _check(self, request: CountTokensRequest, facts: ChatFacts) -> list[ImageRef]:
        """What a count and a generation share: thinking and tools checked,
        and the images, for the door to check and decode."""
        if (
            isinstance(request.thinking, ThinkingEnabled)
            and facts.formats.reasoning is None
        ):
            raise _invalid(
                "thinking",
                "this model does not think (no reasoning format in its chat "
                'template); send thinking {"type": "disabled"} or leave it out.',
            )
        if request.active_tools and facts.formats.tool_call is None:
            raise no_tool_call_format(code=None)
        return image_refs(request.messages, self.config.image_limits)

    async def prepare(self, request: MessagesRequest, facts: ChatFacts) -> Prepared:
        """Raises an ``APIError`` naming the field at fault, a
        ``PromptTooLongError`` or an ``ImageRefusedError``."""
        max_prompt = check_prompt_text(
            self.config, facts, text_chars(request.system, request.messages)
        )
        most = max_tokens(self.config, "max_tokens", request.max_tokens, code=None)
        thinking = request.thinking
        if isinstance(thinking, ThinkingEnabled):
            if thinking.budget_tokens >= request.max_tokens:
                raise _invalid(
                    "thinking.budget_tokens", "it must be less than max_tokens."
                )
        refs = self._check(request, facts)
        grammar = await request_grammar(
            facts.formats.tool_call,
            _forced_call(request),
            _answer_format(request),
            functools.partial(_invalid, "tool_choice"),
        )
        params = request.to_generation_params(
            most,
            max_prompt_tokens=max_prompt,
            context_length=facts.context_length,
            grammar=grammar,
        )
        budget = (
            thinking.budget_tokens if isinstance(thinking, ThinkingEnabled) else None
        )
        kwargs = request.template_kwargs
        params = with_budget(params, facts, kwargs, budget)
        tools = [ToolSpec(t.name, t.input_schema) for t in request.active_tools]
        return _with_turns(Prepared(params, refs, (), tools, kwargs))

    def prepare_count(self, request: CountTokensRequest, facts: ChatFacts) -> Prepared:
        """Check a count's request against the model; its prompt, with no
        limits (a count reports the length, it refuses none)."""
        refs = self._check(request, facts)
        check_media(facts, refs)
        return _with_turns(Prepared(request.prompt_params(1), refs))


def _forced_call(request: MessagesRequest) -> ForcedCall | None:
    """None when no call is forced; a 400 for a forced call with
    ``output_config.format``."""
    choice = request.tool_choice
    if not isinstance(choice, ToolChoiceAny | ToolChoiceTool):
        return None
    output = request.output_config
    if output is not None and output.format is not None:
        raise _invalid(
            "output_config.format",
            "it cannot be combined with a tool_choice that forces a tool call.",
        )
    named = isinstance(choice, ToolChoiceTool)
    active = request.active_tools
    tools = [
        (f"tools[{i}].input_schema", ToolSpec(tool.name, tool.input_schema))
        for i, tool in enumerate(request.tools or [])
        if tool in active
        and (not isinstance(choice, ToolChoiceTool) or tool.name == choice.name)
    ]
    return ForcedCall(tools, not named and not choice.disable_parallel_tool_use)


def _answer_format(request: MessagesRequest) -> tuple[str, Grammar] | None:
    output = request.output_config
    if output is None or output.format is None:
        return None
    schema = json.dumps(output.format.json_schema)
    return "output_config.format.schema", Grammar("json_schema", schema)
