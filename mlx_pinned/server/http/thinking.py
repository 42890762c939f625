"""Thinking budgets from the doors' reasoning fields. Any thread, pure Python.

A request's budget (Anthropic's ``thinking.budget_tokens``, vLLM's
``thinking_token_budget``, or a reasoning effort's level in
:data:`EFFORT_BUDGETS`) goes to the engine with the model's reasoning
markers (:func:`with_budget`); the engine forces the closing marker once
the reasoning has that many tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..events import GenerationParams
    from .capabilities import Capabilities

__all__ = ["EFFORT_BUDGETS", "with_budget"]

#: Reasoning tokens per reasoning effort (chat's ``reasoning_effort``, the
#: Responses API's ``reasoning.effort``); None: no budget.
EFFORT_BUDGETS: Mapping[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": None,
}


def with_budget(
    params: GenerationParams,
    capabilities: Capabilities,
    template_kwargs: Mapping[str, Any],
    budget: int | None,
) -> GenerationParams:
    """``params`` with a thinking ``budget`` and the markers it forces; as
    they are without a budget, for a model with no reasoning markers, or
    for an answer under a grammar (it does not reason)."""
    reasoning = capabilities.formats.reasoning
    if budget is None or reasoning is None or params.grammar is not None:
        return params
    markers = reasoning.budget_markers(
        capabilities.chat_template or "", template_kwargs
    )
    if markers is None:
        return params
    return dataclasses.replace(params, thinking_budget=budget, thinking_markers=markers)
