"""The answer's parts: reasoning, content and tool calls, split alike however
the generated text is cut into pieces."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mlx_pinned.server.formats import CallArguments, CallStart
from mlx_pinned.server.formats.hermes import HERMES, HermesToolParser
from mlx_pinned.server.formats.think import THINK, ReasoningSplitter
from mlx_pinned.server.http.answer_parser import AnswerParser, Reasoning
from mlx_pinned.server.http.chat_completions.bodies import tool_call_id
from mlx_pinned.server.http.chat_completions.output import Answer, delta

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted({p % (len(text) + 1) for p in points})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def parse(
    pieces: list[str], *, reasoning: Any = None, tools: bool = True, cut: bool = False
) -> dict[str, Any]:
    # reasoning: None (the model does not think), "optional" or "opened"
    # (the answer starts inside the reasoning).
    splitter = None if reasoning is None else THINK.parser(reasoning == "opened")
    calls = HERMES.parser() if tools else None
    parser = AnswerParser(reasoning=splitter, tools=calls, call_id=tool_call_id)
    answer = Answer()
    for piece in pieces:
        answer.add(parser.feed(piece))
    answer.add(parser.end(cut=cut))
    answer.thought = parser.thought
    message = answer.message().model_dump()
    for call in message.get("tool_calls") or []:
        call.pop("id")
    return message


class TestReasoning:
    def test_think_block_goes_to_reasoning(self) -> None:
        message = parse(
            ["<think>\nLet me see.\n</think>\n\nParis."], reasoning="optional"
        )
        assert message["reasoning_content"] == "Let me see."
        assert message["content"] == "Paris."

    def test_without_think_all_is_content_unchanged(self) -> None:
        message = parse(["\nHi <think> there"], reasoning="optional")
        assert message["content"] == "\nHi <think> there"
        assert "reasoning_content" not in message

    def test_an_opened_template_starts_in_the_reasoning(self) -> None:
        message = parse(["Hmm.\n</think>\n\nYes."], reasoning="opened")
        assert (message["reasoning_content"], message["content"]) == ("Hmm.", "Yes.")

    def test_reasoning_cut_short_is_all_reasoning(self) -> None:
        message = parse(["<think>still thinking"], reasoning="optional")
        assert (message["reasoning_content"], message["content"]) == (
            "still thinking",
            "",
        )

    def test_a_lone_start_of_think_is_held_then_released(self) -> None:
        splitter = ReasoningSplitter(opened=False)
        assert splitter.feed("<th") == ("", "")
        assert splitter.feed("e") == ("", "<the")

    @given(
        parts=st.lists(
            st.sampled_from(["<think>", "</think>", "\n", "a", "<", "/", ">", " "]),
            max_size=20,
        ),
        points=st.lists(st.integers(0, 200), max_size=8),
        mode=st.sampled_from(["optional", "opened"]),
    )
    def test_any_cut_splits_alike(
        self, parts: list[str], points: list[int], mode: str
    ) -> None:
        whole = "".join(parts)
        expected = parse([whole], reasoning=mode, tools=False)
        assert parse(cut(whole, points), reasoning=mode, tools=False) == expected


class TestToolCalls:
    def test_one_call(self) -> None:
        message = parse([CALL])
        assert message["content"] is None
        assert message["tool_calls"] == [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ]

    def test_calls_between_text(self) -> None:
        message = parse([f"Let me check.\n{CALL}\n{CALL}\nDone."])
        assert message["content"] == "Let me check.Done."
        assert len(message["tool_calls"]) == 2

    def test_text_without_calls_is_content_unchanged(self) -> None:
        text = "a <tool b\n  "
        assert parse([text])["content"] == text

    def test_a_block_that_is_no_call_stays_content(self) -> None:
        text = "x <tool_call>oops</tool_call> y"
        message = parse([text])
        assert message["content"] == text
        assert "tool_calls" not in message

    def test_a_call_cut_short_keeps_its_arguments_so_far(self) -> None:
        message = parse(['<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'])
        assert message["tool_calls"][0]["function"]["arguments"] == '{"a": [1, 2'

    def test_a_call_cut_before_its_arguments_leaves_no_markup(self) -> None:
        for cut_call in ("<tool_call>", '<tool_call>\n{"name": "get_weather",'):
            message = parse([f"Checking.\n{CALL}\n{cut_call}"])
            assert message["content"] == "Checking."
            assert len(message["tool_calls"]) == 1
            assert parse([cut_call])["content"] == ""

    def test_a_cut_in_the_opening_tag_drops_it_only_when_cut(self) -> None:
        assert parse(["Checking.\n<tool_c"], cut=True)["content"] == "Checking."
        assert parse(["a < b <tool_c"])["content"] == "a < b <tool_c"

    def test_a_cut_in_the_closing_tag_leaves_the_arguments_clean(self) -> None:
        message = parse([CALL[:-4]], cut=True)
        assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
        assert message["content"] is None

    def test_escaped_names_are_decoded(self) -> None:
        message = parse(
            ['<tool_call>{"name": "a\\u0062", "arguments": {}}</tool_call>']
        )
        assert message["tool_calls"][0]["function"] == {"name": "ab", "arguments": "{}"}

    def test_stream_pieces_come_in_openai_order(self) -> None:
        parser = HermesToolParser()
        pieces: list[Any] = []
        for char in CALL:
            pieces += parser.feed(char)
        pieces += parser.end()
        assert isinstance(pieces[0], CallStart)
        assert pieces[0].name == "get_weather"
        assert pieces[0].id == ""  # the answer gives it
        fragments = [p.text for p in pieces[1:] if isinstance(p, CallArguments)]
        assert len(fragments) > 1  # streamed, not held to the end
        assert "".join(fragments) == '{"city": "Paris"}'
        assert all(isinstance(p, CallArguments) for p in pieces[1:])

    def test_the_answer_gives_each_call_its_own_id(self) -> None:
        parser = AnswerParser(
            reasoning=None, tools=HERMES.parser(), call_id=tool_call_id
        )
        parts = parser.feed(f"{CALL}\n{CALL}") + parser.end()
        ids = [part.id for part in parts if isinstance(part, CallStart)]
        assert len(ids) == 2
        assert all(i.startswith("call_") for i in ids)
        assert ids[0] != ids[1]

    def test_deltas_carry_name_first_then_fragments(self) -> None:
        first = delta(CallStart(0, "f", "call_x")).model_dump(exclude_none=True)
        assert first["tool_calls"] == [
            {
                "index": 0,
                "id": "call_x",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
        more = delta(CallArguments(0, '{"a"')).model_dump(exclude_none=True)
        assert more["tool_calls"] == [{"index": 0, "function": {"arguments": '{"a"'}}]
        assert delta(Reasoning("r")).reasoning_content == "r"

    @given(
        prefix=st.text(st.sampled_from("ab \n<"), max_size=6),
        arguments=st.recursive(
            st.none()
            | st.integers()
            | st.text(st.sampled_from('ab"}<\\ '), max_size=4),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text("ab}", max_size=2), inner, max_size=3)
            ),
            max_leaves=6,
        ),
        calls=st.integers(1, 3),
        spacing=st.sampled_from(["", "\n", " \n "]),
        cut_at=st.integers(0, 400),
        points=st.lists(st.integers(0, 400), max_size=10),
    )
    def test_any_cut_gives_the_same_calls(
        self,
        prefix: str,
        arguments: Any,
        calls: int,
        spacing: str,
        cut_at: int,
        points: list[int],
    ) -> None:
        call = (
            f'<tool_call>{spacing}{{"name": "f", "arguments": '
            f"{json.dumps(arguments)}}}{spacing}</tool_call>"
        )
        whole = prefix + "\n".join([call] * calls) + "tail"
        whole = whole[: cut_at + len(prefix)]  # cut short anywhere too
        expected = parse([whole])
        assert parse(cut(whole, points)) == expected
        cut_short = parse([whole], cut=True)
        assert parse(cut(whole, points), cut=True) == cut_short
        assert "<tool_c" not in (cut_short["content"] or "")
        for tool_call in expected.get("tool_calls") or []:
            if whole.count("</tool_call>") == calls:
                assert json.loads(tool_call["function"]["arguments"]) == arguments

    @given(
        parts=st.lists(
            st.sampled_from(["<think>", "</think>", CALL, "\n", "x", "<", "}"]),
            max_size=12,
        ),
        points=st.lists(st.integers(0, 600), max_size=10),
    )
    def test_reasoning_and_calls_together_split_alike(
        self, parts: list[str], points: list[int]
    ) -> None:
        text = "".join(parts)
        expected = parse([text], reasoning="optional")
        assert parse(cut(text, points), reasoning="optional") == expected
