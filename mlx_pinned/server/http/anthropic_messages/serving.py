"""Anthropic Messages' one validation site: a parsed request checked against
the served model's :class:`~..capabilities.Capabilities` and this server's
limits, and turned into the shared generation request.

Event loop; a grammar is checked in a worker thread (:mod:`..structured`).
Checked here, once, before the request waits for the model's gate: its text
against the prompt limit, ``max_tokens`` against the server's limit,
``thinking`` against the model's reasoning format, tools against its
tool-call format, the grammar (a forced tool call, or ``output_config``'s
JSON schema), its images. What needs no model is checked by the pydantic
models (:mod:`.protocol`); what needs the exact prompt by the engine.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
)
from ..structured import check_grammar
from ..thinking import with_budget
from .blocks import image_refs, text_chars
from .output import tool_use_id
from .protocol import (
    CountTokensRequest,
    MessagesRequest,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceTool,
)

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ..capabilities import Capabilities

__all__ = ["MessagesServing", "Prepared", "request_grammar"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request checked against its model: the shared generation request
    and its images in prompt order, to decode."""

    params: GenerationParams
    images: list[ImageRef]


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}", param=param)


def _with_turns(prepared: Prepared) -> Prepared:
    """``prepared``, refused if its chat has no turn at all (only empty
    system texts): a chat template has nothing to render."""
    if not prepared.params.messages:
        raise _invalid("messages", "no message has any content; send some text.")
    return prepared


class MessagesServing:
    """Checks Messages requests against the served model and the server's
    limits (``config``: ``max_prompt_tokens``, ``max_tokens_limit``,
    ``image_limits``)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def _check(
        self, request: CountTokensRequest, capabilities: Capabilities
    ) -> list[ImageRef]:
        """What a count and a generation share: thinking, tools, images."""
        if (
            isinstance(request.thinking, ThinkingEnabled)
            and capabilities.formats.reasoning is None
        ):
            raise _invalid(
                "thinking",
                "this model does not think (no reasoning format in its chat "
                'template); send thinking {"type": "disabled"} or leave it out.',
            )
        if request.active_tools and capabilities.formats.tool_call is None:
            raise no_tool_call_format(code=None)
        refs = image_refs(request.messages, self.config.image_limits)
        check_images(
            refs,
            capabilities,
            "this model takes no images; send text blocks only.",
            "images_unsupported",
        )
        return refs

    async def prepare(
        self, request: MessagesRequest, capabilities: Capabilities
    ) -> Prepared:
        """Check ``request`` against the model; its generation request.

        Raises:
            APIError: 400 naming the field at fault.
            PromptTooLongError: Its text alone is over the prompt limit.
            ImageRefusedError: Too many images.
        """
        context = capabilities.context_length
        max_prompt = check_prompt_text(
            self.config, capabilities, text_chars(request.system, request.messages)
        )
        check_max_tokens(
            "max_tokens", request.max_tokens, self.config.max_tokens_limit, code=None
        )
        thinking = request.thinking
        if isinstance(thinking, ThinkingEnabled):
            if thinking.budget_tokens >= request.max_tokens:
                raise _invalid(
                    "thinking.budget_tokens", "it must be less than max_tokens."
                )
        refs = self._check(request, capabilities)
        params = request.to_generation_params(
            request.max_tokens,
            max_prompt_tokens=max_prompt,
            context_length=context,
            grammar=await request_grammar(request, capabilities.formats.tool_call),
        )
        budget = (
            thinking.budget_tokens if isinstance(thinking, ThinkingEnabled) else None
        )
        params = with_budget(params, capabilities, request.template_kwargs, budget)
        return _with_turns(Prepared(params, refs))

    def prepare_count(
        self, request: CountTokensRequest, capabilities: Capabilities
    ) -> Prepared:
        """Check a count's request against the model; its prompt, with no
        limits (a count reports the length, it refuses none)."""
        refs = self._check(request, capabilities)
        return _with_turns(Prepared(request.prompt_params(1), refs))

    def answer_parser(
        self,
        request: MessagesRequest,
        capabilities: Capabilities,
        params: GenerationParams,
    ) -> AnswerParser | None:
        """The parser of the request's answer; None when its text is its
        content (no reasoning to split, no tools the model may call)."""
        return answer_parser(
            capabilities,
            template_kwargs=request.template_kwargs,
            tools=[ToolSpec(t.name, t.input_schema) for t in request.active_tools],
            constrained=params.grammar is not None,
            call_id=tool_use_id,
        )


async def request_grammar(
    request: MessagesRequest, tool_format: ToolCallFormat | None
) -> Grammar | None:
    """The grammar the answer must follow, checked; None if free.

    ``tool_choice`` ``any`` (a call of any tool; one or more unless
    ``disable_parallel_tool_use``) or ``tool`` (exactly one call of it), in
    the model's ``tool_format``; else ``output_config.format``'s schema.

    Raises:
        APIError: 400 naming the schema that cannot be used.
    """
    choice = request.tool_choice
    tools = request.active_tools
    output = request.output_config
    forced = isinstance(choice, ToolChoiceAny | ToolChoiceTool)
    if forced and output is not None and output.format is not None:
        raise _invalid(
            "output_config.format",
            "it cannot be combined with a tool_choice that forces a tool call.",
        )
    if tool_format is not None and isinstance(choice, ToolChoiceAny | ToolChoiceTool):
        if isinstance(choice, ToolChoiceTool):
            tools = [t for t in tools if t.name == choice.name]
        for i, tool in enumerate(request.tools or []):
            if tool in tools:
                schema = json.dumps(json_arguments(tool.input_schema))
                await check_grammar(
                    Grammar("json_schema", schema), f"tools[{i}].input_schema"
                )
        specs = [ToolSpec(t.name, t.input_schema) for t in tools]
        named = isinstance(choice, ToolChoiceTool)
        parallel = not named and not choice.disable_parallel_tool_use
        return await forced_call_grammar(
            tool_format, specs, parallel, functools.partial(_invalid, "tool_choice")
        )
    if output is not None and output.format is not None:
        grammar = Grammar("json_schema", json.dumps(output.format.json_schema))
        await check_grammar(grammar, "output_config.format.schema")
        return grammar
    return None
