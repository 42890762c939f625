"""The ``<think>...</think>`` reasoning format, and Magistral's ``[THINK]``.

Any thread, pure Python. Qwen3, Qwen3-VL-Thinking and DeepSeek-R1 think
between ``<think>`` and ``</think>`` before the answer; Magistral and Gemma 4
write the same shape with their own markers (:func:`tagged`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

from .base import ReasoningFormat, partial_marker

__all__ = [
    "GEMMA4_THINKING",
    "MAGISTRAL",
    "THINK",
    "ReasoningSplitter",
    "opens",
    "tagged",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# The generation prompt: what follows the template's last test of
# add_generation_prompt.
_GENERATION_PROMPT = re.compile(
    r"add_generation_prompt(?!.*add_generation_prompt)", re.S
)


def detect(template: str) -> bool:
    """Whether a chat template thinks in ``<think>`` tags (DeepSeek-R1's
    first template only strips ``</think>`` from the history)."""
    return THINK_OPEN in template or THINK_CLOSE in template


def opens(
    template: str,
    template_kwargs: Mapping[str, Any],
    *,
    opening: str = THINK_OPEN,
    closing: str = THINK_CLOSE,
) -> bool:
    """Whether the template's generation prompt ends with ``<think>``, so
    the answer starts inside the reasoning (an empty pair switches it off).
    One opened only under an ``enable_thinking`` test opens it only when the
    request sets ``enable_thinking: true``, as mlx-vlm passes false unless
    the request says.
    """
    found = _GENERATION_PROMPT.search(template)
    tail = template[found.end() :] if found else ""
    for match in re.finditer(re.escape(opening), tail):
        # An empty pair ('<think>\n\n</think>') switches thinking off.
        if closing in tail[match.end() : match.end() + 24]:
            continue
        guarded = "enable_thinking" in tail[: match.start()]
        if not guarded or template_kwargs.get("enable_thinking") is True:
            return True
    return False


class _State(enum.Enum):
    START = "start"  # nothing decided: the text so far may begin <think>
    REASONING = "reasoning"  # inside <think>, before </think>
    CONTENT = "content"  # the answer


class ReasoningSplitter:
    """Splits generated text, fed piece by piece, into reasoning and content.

    Newlines just inside the tags and just after the closing one are
    dropped, as Qwen's templates drop them when the turn is sent back. An
    answer not ``opened`` (:func:`opens`) that does not begin with the
    opening marker is all content, unchanged.
    """

    def __init__(
        self, opened: bool, *, opening: str = THINK_OPEN, closing: str = THINK_CLOSE
    ) -> None:
        self._opening, self._closing = opening, closing
        self._state = _State.REASONING if opened else _State.START
        self._held = ""
        self._lead = True  # at the start of a section: drop its newlines
        self.thought = opened  # whether any reasoning began

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._held + text, final=False)

    def end(self) -> tuple[str, str]:
        return self._split(self._held, final=True)

    def _split(self, text: str, *, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning = ""
        if self._state is _State.START:
            if text.startswith(self._opening):
                self._state, self.thought = _State.REASONING, True
                text = text[len(self._opening) :]
            elif self._opening.startswith(text) and not final:
                self._held = text
                return "", ""
            else:
                self._state, self._lead = _State.CONTENT, False
        if self._state is _State.REASONING:
            if self._lead:
                text = text.lstrip("\n")
                self._lead = not text
            close = text.find(self._closing)
            if close < 0:
                if final:
                    return text, ""
                # Hold a possible start of </think>, and the newlines before it.
                keep = len(text) - partial_marker(text, self._closing)
                keep = len(text[:keep].rstrip("\n"))
                self._held = text[keep:]
                return text[:keep], ""
            reasoning = text[:close].rstrip("\n")
            text = text[close + len(self._closing) :]
            self._state, self._lead = _State.CONTENT, True
        if self._lead:
            text = text.lstrip("\n")
            self._lead = not text
        return reasoning, text


def tagged(
    name: str, opening: str, closing: str, *, named: str | None = None
) -> ReasoningFormat:
    """A format that thinks between ``opening`` and ``closing``, detected by
    a template that names ``named`` (by default ``opening``)."""

    def detect(template: str) -> bool:
        return (named or opening) in template

    def opens_here(template: str, template_kwargs: Mapping[str, Any]) -> bool:
        return opens(template, template_kwargs, opening=opening, closing=closing)

    def parser(opened: bool) -> ReasoningSplitter:
        return ReasoningSplitter(opened, opening=opening, closing=closing)

    return ReasoningFormat(
        name=name,
        detect=detect,
        opens=opens_here,
        parser=parser,
        markers=(opening, closing),
    )


MAGISTRAL = tagged("magistral", "[THINK]", "[/THINK]")

# A template that names ``<|channel>`` (to strip it from the history)
# thinks in Gemma 4's thought channel.
GEMMA4_THINKING = tagged(
    "gemma4", "<|channel>thought", "<channel|>", named="<|channel>"
)

THINK = ReasoningFormat(
    name="think",
    detect=detect,
    opens=opens,
    parser=ReasoningSplitter,
    markers=(THINK_OPEN, THINK_CLOSE),
)
