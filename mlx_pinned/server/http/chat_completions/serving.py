"""Chat completions' one check against the model: a parsed request against
the model's :class:`~...events.ChatFacts` and this server's limits, before
it waits for the gate, turned into the shared generation request.

Event loop; a grammar is compiled in a worker thread. What needs no model is
checked by :mod:`.protocol`, what needs the exact prompt by the engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ...events import GenerationParams, Grammar
from ...formats import ToolSpec
from ...media import VideoRef
from ...row_needs import needs_of
from ..errors import APIError
from ..serving_common import (
    ForcedCall,
    Prepared,
    check_prompt_text,
    check_scored_stream,
    check_token_fields,
    max_tokens,
    no_tool_call_format,
    request_grammar,
    with_budget,
)
from ..vllm_extensions import conflict
from .messages import (
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
    TextFormat,
    audio_refs,
    image_refs,
    text_chars,
    video_refs,
)

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ...events import ChatFacts
    from .protocol import ChatCompletionRequest

__all__ = ["ChatCompletionsServing"]


class ChatCompletionsServing:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def prepare(
        self, request: ChatCompletionRequest, facts: ChatFacts
    ) -> Prepared:
        """Raises an ``APIError`` naming the parameter at fault, a
        ``PromptTooLongError`` for text alone over the prompt limit, or a
        ``MediaRefusedError`` for too many of a kind of media."""
        # A prompt to be cut is checked once cut, by the engine.
        cut = request.truncate_prompt_tokens is not None
        chars = 0 if cut else text_chars(request.messages)
        max_prompt = check_prompt_text(self.config, facts, chars)
        name = (
            "max_completion_tokens"
            if request.max_completion_tokens is not None
            else "max_tokens"
        )
        most = max_tokens(self.config, name, request.requested_max_tokens)
        tool_format = facts.formats.tool_call
        if request.active_tools and tool_format is None:
            raise no_tool_call_format()
        grammar = await request_grammar(
            tool_format, _forced_call(request), _answer_format(request)
        )
        params = request.to_generation_params(
            most,
            max_prompt_tokens=max_prompt,
            context_length=facts.context_length,
            grammar=grammar,
        )
        kwargs = request.chat_template_kwargs or {}
        params = with_budget(params, facts, kwargs, request.thinking_budget)
        check_token_fields(params, facts.vocab_size)
        check_scored_stream(params, request.stream)
        if params.prediction:
            check_prediction(params)
        refs = image_refs(request.messages, self.config.image_limits)
        tools = [
            ToolSpec(t.function.name, t.function.parameters)
            for t in request.active_tools
        ]
        videos = self._videos(request)
        audios = audio_refs(request.messages, self.config.audio_limits)
        return Prepared(params, refs, videos, tools, kwargs, audios)

    def _videos(self, request: ChatCompletionRequest) -> list[VideoRef]:
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
        fps = request.video_fps
        return video_refs(request.messages, limits, fps=fps, max_frames=asked)


def _forced_call(request: ChatCompletionRequest) -> ForcedCall | None:
    choice = request.tool_choice
    named = isinstance(choice, NamedToolChoice)
    if not request.tools or not (choice == "required" or named):
        return None
    tools = [
        (
            f"tools[{i}].function.parameters",
            ToolSpec(tool.function.name, tool.function.parameters),
        )
        for i, tool in enumerate(request.tools)
        if not isinstance(choice, NamedToolChoice)
        or tool.function.name == choice.function.name
    ]
    return ForcedCall(tools, not named and request.parallel_tool_calls is not False)


def _answer_format(request: ChatCompletionRequest) -> tuple[str, Grammar] | None:
    """``response_format`` or vLLM's spellings of it; None for text. Two of
    them, or one with a forced tool call, are a 400."""
    response_format = request.response_format
    structured = request.structured_grammar()
    if structured is not None:
        param = structured[0]
        if response_format is not None and not isinstance(response_format, TextFormat):
            raise conflict(param, "response_format")
        if _forced_call(request) is not None:
            raise conflict(param, "tool_choice")
        return structured
    if isinstance(response_format, JSONObjectFormat):
        return "response_format", Grammar("json_object")
    if isinstance(response_format, JSONSchemaResponseFormat):
        wanted = response_format.json_schema.json_schema
        return "response_format", Grammar("json_schema", json.dumps(wanted or {}))
    return None


def check_prediction(params: GenerationParams) -> None:
    """Refuse a ``prediction`` beside what its row cannot draft with
    (:attr:`~...row_needs.RowNeeds.undraftable`): it would go unused."""
    undraftable = needs_of(params).undraftable
    if undraftable:
        raise APIError(
            400,
            f"Invalid value for 'prediction': a predicted output cannot be "
            f"used with {undraftable[0].field}; send one or the other.",
            param="prediction",
            code="unsupported_value",
        )
