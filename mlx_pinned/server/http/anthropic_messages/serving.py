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

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...events import GenerationParams, Grammar
from ...formats import (
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    ToolSpec,
    UnforcedCallError,
    json_arguments,
)
from ...limits import check_text_length
from ...media import ImageRef
from ..answer import AnswerParser, answer_parser
from ..errors import APIError
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
            raise APIError(
                400,
                "This model has no tool-call format (none in its chat template, "
                "or tool_call_parser 'none'): send the request without tools, or "
                f"serve it with --tool-call-parser {'|'.join(TOOL_CALL_FORMATS)}.",
                param="tools",
            )
        refs = image_refs(request.messages, self.config.image_limits)
        if refs and not capabilities.accepts_images:
            raise refs[0].error(
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
        max_prompt = self.config.max_prompt_tokens or context
        if max_prompt is not None:
            check_text_length(
                text_chars(request.system, request.messages),
                capabilities.longest_token_chars,
                max_prompt,
            )
        if request.max_tokens > self.config.max_tokens_limit:
            raise _invalid(
                "max_tokens",
                f"{request.max_tokens} is more than this server's limit of "
                f"{self.config.max_tokens_limit} tokens.",
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
        try:
            source = tool_format.grammar(specs, parallel)
        except UnforcedCallError as exc:  # its message names the format
            raise _invalid("tool_choice", str(exc)) from None
        grammar = Grammar("lark", source)
        await check_grammar(grammar, "tools")
        return grammar
    if output is not None and output.format is not None:
        grammar = Grammar("json_schema", json.dumps(output.format.json_schema))
        await check_grammar(grammar, "output_config.format.schema")
        return grammar
    return None
