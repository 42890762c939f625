"""Output formats: how a model writes tool calls and reasoning, as data.

Any thread, pure Python: a shared package, imported by the HTTP side (the
event loop) and by the settings; it imports neither MLX nor a web library.
A format owns its parser (the whole text or piece by piece) and, for tool
calls, the grammar that forces a call; the registry
(:mod:`.registry`) chooses a model's formats from its chat template or its
settings. Nothing outside this package names a format.
"""

from __future__ import annotations

from .base import (
    CallArguments,
    CallStart,
    Piece,
    ReasoningFormat,
    ReasoningParser,
    ToolCallFormat,
    ToolCallParser,
    ToolParserFactory,
    ToolSpec,
    UnforcedCallError,
    json_arguments,
)
from .registry import (
    NONE,
    REASONING_FORMATS,
    TOOL_CALL_FORMATS,
    ModelFormats,
    check_reasoning_parser,
    check_tool_call_parser,
    log_formats,
    model_formats,
    reasoning_format,
    tool_call_format,
)

__all__ = [
    "NONE",
    "REASONING_FORMATS",
    "TOOL_CALL_FORMATS",
    "CallArguments",
    "CallStart",
    "ModelFormats",
    "Piece",
    "ReasoningFormat",
    "ReasoningParser",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolParserFactory",
    "ToolSpec",
    "UnforcedCallError",
    "check_reasoning_parser",
    "check_tool_call_parser",
    "json_arguments",
    "log_formats",
    "model_formats",
    "reasoning_format",
    "tool_call_format",
]
