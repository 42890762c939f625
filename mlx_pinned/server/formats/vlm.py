"""mlx-vlm's tool-call parsers and its template detection, as pure Python.

Any thread. Importing ``mlx_vlm.tools`` would run ``mlx_vlm/__init__``,
which imports MLX, so each of those files (standard library and ``regex``
only) is loaded on its own from where mlx-vlm is installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from .base import ToolSpec

__all__ = ["Decoded", "arguments_text", "vlm_decoder", "vlm_detects", "vlm_parser"]

#: A call, decoded: its name and its arguments as JSON text.
Decoded = tuple[str, str]


@cache
def _root() -> Path:
    spec = importlib.util.find_spec("mlx_vlm")  # finds it, runs nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlx-vlm is not installed: pip install 'mlx-pinned[server]'")
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def _load(dotted: str) -> ModuleType:
    """``mlx_vlm.<dotted>``, imported already or loaded from its file alone."""
    name = f"mlx_vlm.{dotted}"
    if name in sys.modules:
        return sys.modules[name]
    path = _root().joinpath(*dotted.split(".")).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(f"_mlx_pinned_vlm.{dotted}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"mlx-vlm has no {name} at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def vlm_parser(name: str) -> ModuleType:
    return _load(f"tools.parsers.{name}")


def vlm_detects(name: str) -> Callable[[str], bool]:
    """Whether mlx-vlm's own detection gives a chat template the format it
    calls ``name``."""

    def detect(template: str) -> bool:
        return _inferred(template) == name

    return detect


@lru_cache(maxsize=64)
def _inferred(template: str) -> str | None:
    # Cached: every request looks its model's formats up.
    found = _load("tools.registry")._infer_tool_parser(template)
    return found if isinstance(found, str) else None


def _wire_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
        for t in tools
    ]


def arguments_text(arguments: Any) -> str:
    """A call's arguments as JSON text, as mlx-vlm's extractor writes them."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def vlm_decoder(name: str) -> Callable[[str, Sequence[ToolSpec]], list[Decoded]]:
    """A :data:`~.blocks.Decoder` by mlx-vlm's parser ``name``, loaded at
    the first call."""

    def decode(body: str, tools: Sequence[ToolSpec]) -> list[Decoded]:
        module = vlm_parser(name)
        try:
            parsed = module.parse_tool_call(body, _wire_tools(tools) or None)
        except (ValueError, KeyError, TypeError, SyntaxError, IndexError) as exc:
            raise ValueError(f"not a call: {exc}") from None
        calls = parsed if isinstance(parsed, list) else [parsed]
        decoded = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError("not a call: no name")
            decoded.append(
                (call["name"].strip(), arguments_text(call.get("arguments", {})))
            )
        if not decoded:
            raise ValueError("not a call: empty")
        return decoded

    return decode
