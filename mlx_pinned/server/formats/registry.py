"""The formats this server knows, by name, and how a model's are chosen.

Any thread, pure Python. Each model has a tool-call format and a reasoning
format: by default the first entry whose ``detect`` recognises the model's
chat template (None if none does), or the one a setting names
(``tool_call_parser``, ``reasoning_parser``; ``"none"`` turns it off).
Adding a format is one entry in :data:`TOOL_CALL_FORMATS` or
:data:`REASONING_FORMATS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from .base import ReasoningFormat, ToolCallFormat
from .hermes import HERMES
from .think import THINK

__all__ = [
    "NONE",
    "REASONING_FORMATS",
    "TOOL_CALL_FORMATS",
    "ModelFormats",
    "check_reasoning_parser",
    "check_tool_call_parser",
    "model_formats",
    "reasoning_format",
    "tool_call_format",
]

#: The setting's value that turns a kind of format off.
NONE = "none"

#: Tool-call formats by name, in the order detection tries them. The first
#: is also the format of a model with no chat template (the Qwen-VL family).
TOOL_CALL_FORMATS: Mapping[str, ToolCallFormat] = {f.name: f for f in (HERMES,)}

#: Reasoning formats by name, in the order detection tries them.
REASONING_FORMATS: Mapping[str, ReasoningFormat] = {f.name: f for f in (THINK,)}

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
    """The tool-call format called ``name``; None for ``"none"``.

    Raises:
        ValueError: No format has that name (the message lists those known).
    """
    return _named(TOOL_CALL_FORMATS, "tool_call_parser", name)


def reasoning_format(name: str) -> ReasoningFormat | None:
    """The reasoning format called ``name``; None for ``"none"``.

    Raises:
        ValueError: No format has that name (the message lists those known).
    """
    return _named(REASONING_FORMATS, "reasoning_parser", name)


def check_tool_call_parser(name: str) -> str:
    """``name``, if it names a tool-call format or is ``"none"``.

    Raises:
        ValueError: It does not (the message lists the names known).
    """
    tool_call_format(name)
    return name


def check_reasoning_parser(name: str) -> str:
    """``name``, if it names a reasoning format or is ``"none"``.

    Raises:
        ValueError: It does not (the message lists the names known).
    """
    reasoning_format(name)
    return name


@dataclass(frozen=True, slots=True)
class ModelFormats:
    """The formats a model's answers are read in (None: it has none).

    Attributes:
        tool_call: How it writes tool calls.
        reasoning: How it writes its reasoning.
    """

    tool_call: ToolCallFormat | None
    reasoning: ReasoningFormat | None


def model_formats(
    template: str | None,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ModelFormats:
    """The formats of a model with this chat ``template`` (None: it has
    none): those the settings name, else those detected.

    Raises:
        ValueError: A setting names no known format.
    """
    if tool_call_parser is not None:
        tools = tool_call_format(tool_call_parser)
    elif template is None:
        tools = next(iter(TOOL_CALL_FORMATS.values()))
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
