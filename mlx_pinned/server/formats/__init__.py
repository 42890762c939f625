"""Output formats: how a model writes tool calls and reasoning, as data.

Any thread, pure Python (no MLX, no web library). A format owns its parsers
and, for tool calls, the grammar that forces a call; :mod:`.registry`
chooses a model's formats. Nothing outside this package names a format.
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
