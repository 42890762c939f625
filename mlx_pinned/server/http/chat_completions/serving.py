"""Chat completions' one validation site: a parsed request checked against
the served model's :class:`~..capabilities.Capabilities` and this server's
limits, and turned into the shared generation request.

Event loop; a grammar is checked in a worker thread (:mod:`..structured`).
Everything about a request that depends on the model or on the server's
settings is checked here, once, before the request waits for the model's
gate: its text against the prompt limit, ``max_tokens`` against the
server's limit, tools against the model's tool-call format, the grammar,
``logit_bias`` against the vocabulary, its images and videos (how many,
whether the model takes any, the frames a request asks for). What needs
no model is checked by the pydantic models (:mod:`.protocol`); what needs
the exact prompt (its length in tokens) by the engine, on the MLX thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...events import GenerationParams, Grammar
from ...formats import ToolCallFormat, ToolSpec, json_arguments
from ...media import ImageRef, VideoRef
from ..answer import AnswerParser, answer_parser
from ..errors import APIError
from ..serving_common import (
    check_images,
    check_logit_bias,
    check_max_tokens,
    check_prompt_text,
    forced_call_grammar,
    no_tool_call_format,
    unforced_call,
)
from ..structured import check_grammar
from ..thinking import with_budget
from .messages import (
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
    image_refs,
    text_chars,
    video_refs,
)
from .responses import tool_call_id

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ..capabilities import Capabilities
    from .protocol import ChatCompletionRequest

__all__ = ["ChatCompletionsServing", "Prepared", "request_grammar"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request checked against its model, as the engine and the image and
    video decoders take it.

    Attributes:
        params: The shared generation request (its ``videos`` are set once
            they are decoded).
        images: Its images in prompt order, to decode.
        videos: Its videos in prompt order, to decode.
    """

    params: GenerationParams
    images: list[ImageRef]
    videos: list[VideoRef]


class ChatCompletionsServing:
    """Checks chat-completions requests against the served model and the
    server's limits (``config``: ``max_prompt_tokens``,
    ``default_max_tokens``, ``max_tokens_limit``, ``image_limits``)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def prepare(
        self, request: ChatCompletionRequest, capabilities: Capabilities
    ) -> Prepared:
        """Check ``request`` against the model; its generation request.

        Raises:
            APIError: 400 naming the parameter at fault.
            PromptTooLongError: Its text alone is over the prompt limit.
            ImageRefusedError: Too many images.
            ImagesUnsupportedError: Images, and the model takes none.
            VideoRefusedError: Too many videos, or the model takes none.
        """
        context = capabilities.context_length
        max_prompt = check_prompt_text(
            self.config, capabilities, text_chars(request.messages)
        )
        max_tokens = self.max_tokens(request)
        tool_format = capabilities.formats.tool_call
        if request.active_tools and tool_format is None:
            raise no_tool_call_format()
        params = request.to_generation_params(
            max_tokens,
            max_prompt_tokens=max_prompt,
            context_length=context,
            grammar=await request_grammar(request, tool_format),
        )
        params = with_budget(
            params,
            capabilities,
            request.chat_template_kwargs or {},
            request.thinking_budget,
        )
        check_logit_bias(params, capabilities.vocab_size)
        refs = image_refs(request.messages, self.config.image_limits)
        check_images(
            refs,
            capabilities,
            "this model takes no images; send text parts only.",
            "images_unsupported",
        )
        return Prepared(params, refs, self._videos(request, capabilities))

    def _videos(
        self, request: ChatCompletionRequest, capabilities: Capabilities
    ) -> list[VideoRef]:
        limits = self.config.video_limits
        asked = request.video_max_frames
        if asked is not None and asked > limits.max_frames:
            raise APIError(
                400,
                f"Invalid value for 'video_max_frames': {asked} is more than this "
                f"server's limit of {limits.max_frames} frames per video.",
                param="video_max_frames",
                code="invalid_value",
            )
        refs = video_refs(
            request.messages,
            limits,
            fps=request.video_fps,
            max_frames=asked,
        )
        check_images(
            refs,
            capabilities,
            "this model takes no videos; send text parts only.",
            "videos_unsupported",
        )
        return refs

    def max_tokens(self, request: ChatCompletionRequest) -> int:
        """The request's ``max_completion_tokens`` (or ``max_tokens``), else
        the server's default.

        Raises:
            APIError: 400 over the server's ``max_tokens_limit``.
        """
        asked = request.requested_max_tokens
        if asked is None:
            return self.config.default_max_tokens
        name = (
            "max_completion_tokens"
            if request.max_completion_tokens is not None
            else "max_tokens"
        )
        return check_max_tokens(name, asked, self.config.max_tokens_limit)

    def answer_parser(
        self,
        request: ChatCompletionRequest,
        capabilities: Capabilities,
        params: GenerationParams,
    ) -> AnswerParser | None:
        """The parser of the request's answer; None when its text is its
        content (no reasoning to split, no tools the model may call)."""
        return answer_parser(
            capabilities,
            template_kwargs=request.chat_template_kwargs or {},
            tools=[
                ToolSpec(t.function.name, t.function.parameters)
                for t in request.active_tools
            ],
            constrained=params.grammar is not None,
            call_id=tool_call_id,
        )


async def request_grammar(
    request: ChatCompletionRequest, tool_format: ToolCallFormat | None
) -> Grammar | None:
    """The grammar the request's answer must follow, checked; None if free.

    ``response_format`` ``json_object`` or ``json_schema``; ``tool_choice``
    ``required`` (one call, or with ``parallel_tool_calls`` not false, one or
    more, of the tools) or a named function (exactly one call to it), in the
    model's ``tool_format``.

    Raises:
        APIError: 400 naming the schema that cannot be used, or the format
            that cannot force a call to the tools.
    """
    choice = request.tool_choice
    named = isinstance(choice, NamedToolChoice)
    if tool_format is not None and request.tools and (choice == "required" or named):
        tools = request.tools
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == choice.function.name]
        for i, tool in enumerate(request.tools):
            if tool in tools and tool.function.parameters is not None:
                schema = json.dumps(json_arguments(tool.function.parameters))
                await check_grammar(
                    Grammar("json_schema", schema), f"tools[{i}].function.parameters"
                )
        specs = [ToolSpec(t.function.name, t.function.parameters) for t in tools]
        parallel = not named and request.parallel_tool_calls is not False
        return await forced_call_grammar(tool_format, specs, parallel, unforced_call)
    response_format = request.response_format
    if isinstance(response_format, JSONObjectFormat):
        return Grammar("json_object")
    if isinstance(response_format, JSONSchemaResponseFormat):
        wanted = response_format.json_schema.json_schema
        # As sent: the engine compiles a response_format schema's JSON
        # compactly itself.
        grammar = Grammar("json_schema", json.dumps(wanted or {}))
        await check_grammar(grammar, "response_format")
        return grammar
    return None
