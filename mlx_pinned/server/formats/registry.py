"""The formats this server knows, by name, and how a model's are chosen:
the one a setting names, else the first whose ``detect`` recognises the
chat template. Adding a format is one entry here. Any thread, pure Python.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from .base import ReasoningFormat, ToolCallFormat
from .deepseek import DEEPSEEK_V3, DEEPSEEK_V31
from .gemma4 import GEMMA4
from .glm47 import GLM47
from .harmony import HARMONY, HARMONY_REASONING
from .hermes import HERMES
from .kimi_k2 import KIMI_K2
from .llama3 import LLAMA3_JSON
from .mistral import MISTRAL, MISTRAL_V11
from .pythonic import PYTHONIC
from .qwen3_coder import QWEN3_CODER
from .think import GEMMA4_THINKING, MAGISTRAL, THINK

__all__ = [
    "NONE",
    "REASONING_FORMATS",
    "TOOL_CALL_FORMATS",
    "ModelFormats",
    "check_reasoning_parser",
    "check_tool_call_parser",
    "log_formats",
    "model_formats",
    "reasoning_format",
    "tool_call_format",
]

logger = logging.getLogger("mlx_pinned.server")

NONE = "none"

#: Tool-call formats by name, in the order detection tries them: Hermes'
#: JSON comes last, since other formats write ``<tool_call>`` too (Qwen3-Coder's
#: XML, GLM's keys and values).
TOOL_CALL_FORMATS: Mapping[str, ToolCallFormat] = {
    f.name: f
    for f in (
        QWEN3_CODER,
        GLM47,
        MISTRAL_V11,
        MISTRAL,
        LLAMA3_JSON,
        PYTHONIC,
        KIMI_K2,
        DEEPSEEK_V3,
        DEEPSEEK_V31,
        GEMMA4,
        HARMONY,
        HERMES,
    )
}

#: The tool-call format of a model with no chat template (the Qwen-VL family).
UNTEMPLATED = HERMES

REASONING_FORMATS: Mapping[str, ReasoningFormat] = {
    f.name: f for f in (HARMONY_REASONING, MAGISTRAL, GEMMA4_THINKING, THINK)
}

F = TypeVar("F", ToolCallFormat, ReasoningFormat)


def _named(formats: Mapping[str, F], setting: str, name: str) -> F | None:
    if name == NONE:
        return None
    try:
        return formats[name]
    except KeyError:
        known = ", ".join([*formats, NONE])
        raise ValueError(
            f"{setting} {name!r} is not a format this server knows: give one of {known}"
        ) from None


def tool_call_format(name: str) -> ToolCallFormat | None:
    """None for ``"none"``; a ValueError listing the names known if no
    format has that name."""
    return _named(TOOL_CALL_FORMATS, "tool_call_parser", name)


def reasoning_format(name: str) -> ReasoningFormat | None:
    """As :func:`tool_call_format`."""
    return _named(REASONING_FORMATS, "reasoning_parser", name)


def check_tool_call_parser(name: str) -> str:
    """``name``, if :func:`tool_call_format` takes it."""
    tool_call_format(name)
    return name


def check_reasoning_parser(name: str) -> str:
    """``name``, if :func:`reasoning_format` takes it."""
    reasoning_format(name)
    return name


@dataclass(frozen=True, slots=True)
class ModelFormats:
    """The formats a model's answers are read in (None: it has none)."""

    tool_call: ToolCallFormat | None
    reasoning: ReasoningFormat | None

    def names(self) -> dict[str, str | None]:
        """Each kind's format by name (None: none), as ``/v1/models`` shows."""
        return {
            "tool_calls": None if self.tool_call is None else self.tool_call.name,
            "reasoning": None if self.reasoning is None else self.reasoning.name,
        }


def model_formats(
    template: str | None,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ModelFormats:
    """The formats of a model with this chat ``template`` (None: it has
    none); a ValueError if a setting names no known format."""
    if tool_call_parser is not None:
        tools = tool_call_format(tool_call_parser)
    elif template is None:
        tools = UNTEMPLATED
    else:
        tools = next(
            (f for f in TOOL_CALL_FORMATS.values() if f.detect(template)), None
        )
    if reasoning_parser is not None:
        reasoning = reasoning_format(reasoning_parser)
    else:
        found = (
            f for f in REASONING_FORMATS.values() if template and f.detect(template)
        )
        reasoning = next(found, None)
    return ModelFormats(tools, reasoning)


def log_formats(
    model: str,
    formats: ModelFormats,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> None:
    """Log ``model``'s formats in one line, and whether each was set or
    detected."""
    names = formats.names()
    logger.info(
        "model %r: tool calls in %s (%s), reasoning in %s (%s)",
        model,
        names["tool_calls"] or NONE,
        "set" if tool_call_parser is not None else "detected",
        names["reasoning"] or NONE,
        "set" if reasoning_parser is not None else "detected",
    )
