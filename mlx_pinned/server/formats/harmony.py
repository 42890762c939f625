"""gpt-oss's harmony format: messages in channels, for reasoning and calls.

Any thread, pure Python. gpt-oss answers in messages,
``<|channel|>CHANNEL<|message|>TEXT`` ended by ``<|end|>``: its reasoning
in ``analysis``, its answer in ``final``, a call as ``<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}`` ended by ``<|call|>``
(a stop token). :class:`HarmonySplitter` splits the channels and passes a
call's message whole to the tool-call parser (mlx-vlm's); it is written here
because mlx-vlm reads no channels and ``openai-harmony`` parses token ids.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    ReasoningFormat,
    ToolCallFormat,
    ToolSpec,
    json_arguments,
    partial_marker,
)
from .blocks import CallSyntax, grammar_of_calls, literal
from .vlm import vlm_decoder, vlm_detects

__all__ = ["HARMONY", "HARMONY_REASONING", "HarmonySplitter", "grammar"]

NAME = "harmony"
CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
CALL_OPEN = "<|channel|>commentary to="
CALL = "<|call|>"
# What ends a message's text.
_ENDS = ("<|end|>", CALL, "<|return|>", START)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


class _Calls(CallSyntax):
    """A call from its commentary header to ``<|call|>`` or the next message."""

    open_ended = True  # <|call|> is a stop token

    def __init__(self) -> None:
        super().__init__(vlm_decoder(NAME))

    def start(self, text: str, *, first: bool) -> tuple[int, int] | None:
        begin = text.find(CALL_OPEN)
        return None if begin < 0 else (begin, begin + len(CALL_OPEN))

    def held(self, text: str, *, first: bool) -> int:
        return partial_marker(text, CALL_OPEN)

    def end(self, body: str) -> tuple[int, int] | None:
        message = body.find(MESSAGE)
        if message < 0:
            return None
        found = [(body.find(e, message), e) for e in _ENDS if e in body[message:]]
        if not found:
            return None
        at, marker = min(found)
        return at, at + (0 if marker == START else len(marker))


_CALLS = _Calls()


def _call(i: int, tool: ToolSpec) -> list[str]:
    head = literal(f"{CALL_OPEN}functions.{tool.name} <|constrain|>json{MESSAGE}")
    schema = json.dumps(json_arguments(tool.parameters))
    return [f"call_{i}: {head} args_{i}", f"args_{i}: %json {schema}"]


def grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """One call even with ``parallel``: harmony ends the turn with each."""
    return grammar_of_calls(tools, False, _call)


class _State(enum.Enum):
    START = "start"  # nothing yet: harmony markup, or plain text
    HEADER = "header"  # a message's header, before <|message|>
    BODY = "body"  # a message's text
    PLAIN = "plain"  # an answer with no harmony markup: all content


class _Kind(enum.Enum):
    REASONING = "reasoning"  # the analysis channel
    CONTENT = "content"  # the final channel, a preamble
    CALL = "call"  # a commentary message to a function: passed on whole


class HarmonySplitter:
    """Splits harmony text, fed piece by piece, into reasoning and content
    (a call's message goes to the content whole, for the tool-call parser);
    ``opened`` is unused: every message names its channel."""

    def __init__(self, opened: bool = False) -> None:
        self._state = _State.START
        self._kind = _Kind.CONTENT
        self._held = ""
        self.thought = False

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._held + text, final=False)

    def end(self) -> tuple[str, str]:
        return self._split(self._held, final=True)

    def _split(self, text: str, *, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state is _State.START:
                if text.startswith((CHANNEL, START)):
                    self._state = _State.HEADER
                elif not final and (CHANNEL.startswith(text) or START.startswith(text)):
                    self._held = text
                    break
                else:
                    self._state = _State.PLAIN
            if self._state is _State.PLAIN:
                content.append(text)
                break
            if self._state is _State.HEADER:
                at = text.find(MESSAGE)
                if at < 0:
                    self._held = "" if final else text  # a cut header is markup
                    break
                self._open(text[:at], content)
                text = text[at + len(MESSAGE) :]
                self._state = _State.BODY
                continue
            found = [(text.find(e), e) for e in _ENDS if e in text]
            if not found:
                keep = len(text) if final else len(text) - self._partial(text)
                self._write(text[:keep], reasoning, content)
                self._held = text[keep:]
                break
            at, marker = min(found)
            self._write(text[:at], reasoning, content)
            if self._kind is _Kind.CALL and marker == CALL:
                content.append(CALL)
            text = text[at + (0 if marker == START else len(marker)) :]
            self._state = _State.HEADER
        return "".join(reasoning), "".join(content)

    @staticmethod
    def _partial(text: str) -> int:
        return max(partial_marker(text, e) for e in _ENDS)

    def _open(self, header: str, content: list[str]) -> None:
        channel = _CHANNEL_NAME.search(header)
        name = channel[1] if channel else ""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            # Written as the tool-call parser reads it, wherever the header
            # named the recipient (after the channel, or after the role).
            self._kind = _Kind.CALL
            content.append(f"{CALL_OPEN}{recipient[1]} {MESSAGE}")
        elif name == "analysis":
            self._kind, self.thought = _Kind.REASONING, True
        else:
            self._kind = _Kind.CONTENT

    def _write(self, text: str, reasoning: list[str], content: list[str]) -> None:
        (reasoning if self._kind is _Kind.REASONING else content).append(text)


def detect_reasoning(template: str) -> bool:
    """Whether a chat template thinks in harmony's analysis channel."""
    return "<|channel|>" in template and "analysis" in template


def _opens(template: str, template_kwargs: Mapping[str, Any]) -> bool:
    return False  # each message names its channel


HARMONY = ToolCallFormat(
    name=NAME,
    detect=vlm_detects(NAME),
    parser=_CALLS.parser,
    grammar=grammar,
    markers=(CHANNEL, MESSAGE, START, CALL, "<|constrain|>", "to=functions."),
)

HARMONY_REASONING = ReasoningFormat(
    name=NAME,
    detect=detect_reasoning,
    opens=_opens,
    parser=HarmonySplitter,
    # The analysis message, closed and followed by the final one's header.
    markers=(
        f"{CHANNEL}analysis{MESSAGE}",
        f"<|end|>{START}assistant{CHANNEL}final{MESSAGE}",
    ),
)
