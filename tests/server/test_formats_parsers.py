"""Every output format's parser on answers written in the format's real
syntax: calls and content come out exactly, whole or streamed in any
pieces, no markup reaches the content (whole, or cut at any point), a
forced call parses back to valid arguments, and each family's template is
detected as its format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_pinned.server.formats import (
    REASONING_FORMATS,
    TOOL_CALL_FORMATS,
    CallArguments,
    CallStart,
    ReasoningFormat,
    ToolSpec,
    UnforcedCallError,
    model_formats,
)
from mlx_pinned.server.formats.blocks import MAX_FORCED_CALLS

from .format_cases import (
    BAR,
    CASES,
    CLOCK,
    DS_CALL,
    DS_OPEN,
    DS_SEP,
    FORCED,
    FORCED_TEXT,
    PLAN,
    PLAN_ARGUMENTS,
    PLAN_TEXT,
    TOOLS,
    Case,
)

IDS = [f"{case.format}-{i}" for i, case in enumerate(CASES)]


@dataclass
class Parsed:
    content: str
    calls: list[tuple[str, str]]


def parse(name: str, text: str, sizes: list[int], *, cut: bool = False) -> Parsed:
    """``text`` through the format's parser in pieces of ``sizes`` (cycled)."""
    parser = TOOL_CALL_FORMATS[name].parser(TOOLS)
    pieces, at, i = [], 0, 0
    while at < len(text):
        size = sizes[i % len(sizes)]
        pieces += parser.feed(text[at : at + size])
        at, i = at + size, i + 1
    pieces += parser.end(cut=cut)
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if isinstance(piece, CallStart):
            assert piece.index == len(calls), "calls start in order"
            calls[piece.index] = [piece.name, ""]
        elif isinstance(piece, CallArguments):
            calls[piece.index][1] += piece.text
    assert parser.calls == len(calls)
    return Parsed(content, [(n, a) for n, a in calls.values()])


class TestParsers:
    @pytest.mark.parametrize("case", CASES, ids=IDS)
    def test_an_answer_parses_to_its_content_and_calls(self, case: Case) -> None:
        parsed = parse(case.format, case.text, [len(case.text)])
        assert parsed.content == case.content
        assert [(n, json.loads(a)) for n, a in parsed.calls] == case.calls
        for marker in case.markup:
            assert marker not in parsed.content

    @pytest.mark.parametrize("case", CASES, ids=IDS)
    @pytest.mark.parametrize("size", [1, 3, 7])
    def test_a_streamed_answer_joins_to_the_whole_one(
        self, case: Case, size: int
    ) -> None:
        whole = parse(case.format, case.text, [len(case.text)])
        assert parse(case.format, case.text, [size]) == whole

    @pytest.mark.slow
    @pytest.mark.parametrize("case", CASES, ids=IDS)
    @settings(max_examples=20, deadline=None)
    @given(sizes=st.lists(st.integers(1, 24), min_size=1, max_size=12))
    def test_any_cutting_of_the_stream_gives_the_same_parts(
        self, case: Case, sizes: list[int]
    ) -> None:
        whole = parse(case.format, case.text, [len(case.text)])
        assert parse(case.format, case.text, sizes) == whole

    @pytest.mark.slow
    @pytest.mark.parametrize("case", CASES, ids=IDS)
    def test_an_answer_cut_anywhere_leaves_no_markup(self, case: Case) -> None:
        for end in range(len(case.text)):
            parsed = parse(case.format, case.text[:end], [7], cut=True)
            for marker in case.markup:
                assert marker not in parsed.content, (end, parsed)
            # What is content of the cut answer is content of the whole one.
            assert case.content.startswith(parsed.content.rstrip()), (end, parsed)

    def test_a_closed_block_that_is_no_call_stays_content(self) -> None:
        text = "See <tool_call>\n<function=oops\n</tool_call> here"
        parsed = parse("qwen3_coder", text, [3])
        assert parsed.calls == []
        assert parsed.content == text

    @pytest.mark.parametrize("cut", [True, False])
    def test_a_block_left_open_is_no_call_and_no_content(self, cut: bool) -> None:
        # Without its closing marker a block is no call (a cut name would
        # be a call to the wrong function), and its markup goes too.
        for name, text in [
            ("glm47", "Hi <tool_call>get_wea"),
            ("qwen3_coder", "Hi <tool_call>\n<function=get_time>\n</function>\n"),
            (
                "kimi_k2",
                "Hi <|tool_calls_section_begin|><|tool_call_begin|>functions.g",
            ),
            ("gemma4", 'Hi <|tool_call>call:get_time{zone:<|"|>UTC<|"|>}'),
        ]:
            assert parse(name, text, [3], cut=cut) == Parsed("Hi", []), name

    def test_json_that_is_no_llama3_call_stays_content(self) -> None:
        for text in ('{"answer": 42} is it', '{"answer": 4'):
            parsed = parse("llama3_json", text, [2])
            assert (parsed.content, parsed.calls) == (text, [])

    def test_every_format_has_a_case(self) -> None:
        assert {case.format for case in CASES} >= set(TOOL_CALL_FORMATS) - {"harmony"}


# Each family's distinctive template markup, as its chat template writes it.
TEMPLATES = {
    "qwen3_coder": (
        "{%- if tools %}<tools>{% endif %}{{- '<tool_call>\\n<function=' + "
        "tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + '>\\n' }}"
    ),
    "glm47": (
        "{{- '<tool_call>' + tc.name -}}{% for k, v in _args.items() %}"
        "<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>{% endfor %}"
        "</tool_call>"
    ),
    "mistral_v11": (
        "{%- for tool in message.tool_calls %}{{- '[TOOL_CALLS]' + "
        "tool.function.name + '[ARGS]' + tool.function.arguments|tojson }}"
    ),
    "mistral": (
        "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}"
        '{{- {"name": tool_call.function.name, "arguments": '
        "tool_call.function.arguments}|tojson }}{% endfor %}{{- ']' }}"
    ),
    "llama3_json": (
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
        "{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
        "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    ),
    "pythonic": (
        "{{- '<|tool_list_start|>' + tools|tojson + '<|tool_list_end|>' }}"
        "{{- '<|tool_call_start|>[' }}...{{- ']<|tool_call_end|>' }}"
    ),
    "kimi_k2": (
        "{{- '<|tool_calls_section_begin|>' -}}{%- for tool_call in "
        "message['tool_calls'] -%}{{- '<|tool_call_begin|>' + tool_call['id'] }}"
    ),
    "deepseek_v3": (
        f"{{{{'<{BAR}Assistant{BAR}>{DS_OPEN}{DS_CALL}' + tool['type'] + "
        f"'{DS_SEP}' + tool['function']['name'] + '\\n' + '```json' }}}}"
    ),
    "deepseek_v31": (
        f"{{{{'{DS_OPEN}{DS_CALL}' + tool['function']['name'] + '{DS_SEP}' + "
        "tool['function']['arguments'] }}"
    ),
    "gemma4": "{{- '<|tool_call>call:' + function['name'] + '{' -}}",
    "harmony": (
        "{{- '<|start|>assistant<|channel|>analysis<|message|>' }}"
        "{{- '<|channel|>commentary to=functions.' + tool_call.name }}"
        "{{- '<|call|>' }}"
    ),
    "hermes": (
        '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
        '{{- \'", "arguments": \' }}'
    ),
}


class TestDetection:
    @pytest.mark.parametrize("name", list(TEMPLATES))
    def test_a_family_template_is_detected_as_its_format(self, name: str) -> None:
        found = model_formats(TEMPLATES[name]).tool_call
        assert found is not None
        assert found.name == name

    def test_every_tool_call_format_has_a_template(self) -> None:
        assert set(TEMPLATES) == set(TOOL_CALL_FORMATS)

    @pytest.mark.parametrize(
        ("template", "name"),
        [
            (TEMPLATES["harmony"], "harmony"),
            ("{{- '[SYSTEM_PROMPT]' }}Think in [THINK]...[/THINK] first.", "magistral"),
            (
                "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                "{% endif %}",
                "think",
            ),
            ("{% set content = content.split('</think>')[-1] %}", "think"),
        ],
    )
    def test_a_reasoning_template_is_detected_as_its_format(
        self, template: str, name: str
    ) -> None:
        found = model_formats(template).reasoning
        assert found is not None
        assert found.name == name


def split(fmt: ReasoningFormat, text: str, size: int, opened: bool) -> tuple[str, str]:
    parser = fmt.parser(opened)
    reasoning, content = "", ""
    for at in range(0, len(text), size):
        more = parser.feed(text[at : at + size])
        reasoning, content = reasoning + more[0], content + more[1]
    more = parser.end()
    return reasoning + more[0], content + more[1]


DEEPSEEK_R1 = (
    "{% set content = content.split('</think>')[-1] %}"
    f"{{% if add_generation_prompt and not ns.is_tool %}}{{{{'<{BAR}Assistant{BAR}>"
    "<think>\\n'}}{% endif %}"
)
QWEN3_THINKING = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}"
)


class TestReasoning:
    @pytest.mark.parametrize("template", [DEEPSEEK_R1, QWEN3_THINKING])
    @pytest.mark.parametrize("size", [1, 3, 7, 1000])
    def test_a_template_that_opens_think_starts_the_answer_in_it(
        self, template: str, size: int
    ) -> None:
        fmt = model_formats(template).reasoning
        assert fmt is not None
        opened = fmt.opens(template, {})
        assert opened
        text = "Hmm, 2 + 2 — <thinking> is 4.\n</think>\n\nIt is 4 ✓"
        assert split(fmt, text, size, opened) == (
            "Hmm, 2 + 2 — <thinking> is 4.",
            "It is 4 ✓",
        )

    @pytest.mark.parametrize("size", [1, 3, 7, 1000])
    def test_magistral_thinks_in_think_brackets(self, size: int) -> None:
        fmt = REASONING_FORMATS["magistral"]
        assert not fmt.opens("[THINK] {% if add_generation_prompt %}{% endif %}", {})
        text = "[THINK]Is [THINK 1] right? Yes.[/THINK]Réponse: oui."
        assert split(fmt, text, size, False) == (
            "Is [THINK 1] right? Yes.",
            "Réponse: oui.",
        )
        plain = "No thinking [THINK] here."
        assert split(fmt, plain, size, False) == ("", plain)

    @pytest.mark.parametrize("size", [1, 3, 7, 1000])
    def test_gemma4_thinks_in_its_thought_channel(self, size: int) -> None:
        template = (
            "{%- if enable_thinking %}<|think|>{% endif %}{%- macro strip(t) -%}"
            "{{- t.split('<channel|>')[-1] if '<|channel>' in t else t -}}"
            "{%- endmacro -%}{%- if add_generation_prompt %}<|turn>model\n"
            "{%- endif %}"
        )
        fmt = model_formats(template).reasoning
        assert fmt is REASONING_FORMATS["gemma4"]
        assert not fmt.opens(template, {"enable_thinking": True})
        text = "<|channel>thought\nIs <channel> 4? Yes.<channel|>It is 4 ✓"
        assert split(fmt, text, size, False) == ("Is <channel> 4? Yes.", "It is 4 ✓")
        plain = "No thought <|channel>thought here."
        assert split(fmt, plain, size, False) == ("", plain)
        harmony = "<|channel|>analysis<|message|>x"
        assert model_formats(harmony).reasoning is REASONING_FORMATS["harmony"]

    @pytest.mark.parametrize("size", [1, 3, 7, 1000])
    def test_harmony_channels_split_reasoning_content_and_calls(
        self, size: int
    ) -> None:
        fmt = REASONING_FORMATS["harmony"]
        answer = (
            "<|channel|>analysis<|message|>User wants weather; "
            "say <|channel|>final? no.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Sunny — ☀ in Oslo."
        )
        assert split(fmt, answer, size, False) == (
            "User wants weather; say <|channel|>final? no.",
            "Sunny — ☀ in Oslo.",
        )
        call = (
            "<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Oslo", "options": {"units": {"temp": "C"}}}<|call|>'
        )
        reasoning, content = split(fmt, call, size, False)
        assert reasoning == "Need a tool."
        parsed = parse("harmony", content, [size])
        assert parsed.content == ""
        assert [(n, json.loads(a)) for n, a in parsed.calls] == [
            ("get_weather", {"city": "Oslo", "options": {"units": {"temp": "C"}}})
        ]

    def test_harmony_plain_text_is_content(self) -> None:
        fmt = REASONING_FORMATS["harmony"]
        assert split(fmt, "Just text.", 3, False) == ("", "Just text.")

    def test_a_harmony_call_cut_by_the_stop_token_is_read(self) -> None:
        # <|call|> is a stop token: the text ends with the arguments.
        content = (
            "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
            '{"zone": "UTC"}'
        )
        parsed = parse("harmony", content, [4])
        assert parsed.calls == [("get_time", '{"zone": "UTC"}')]
        assert parsed.content == ""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return llguidance.LLTokenizer(str(tiny_model_path / "tokenizer.json"))


class TestForcedCalls:
    def test_every_format_has_a_forced_text(self) -> None:
        assert set(FORCED_TEXT) == set(TOOL_CALL_FORMATS)

    @pytest.mark.parametrize("name", list(FORCED_TEXT))
    def test_the_grammar_accepts_its_call_and_the_parser_reads_it(
        self, name: str, tokenizer: Any
    ) -> None:
        fmt = TOOL_CALL_FORMATS[name]
        source = fmt.grammar([FORCED, CLOCK], False)
        matcher = llguidance.LLMatcher(
            tokenizer, llguidance.grammar_from("lark", source), log_level=0
        )
        text = FORCED_TEXT[name]
        assert matcher.consume_tokens(tokenizer.tokenize_str(text)), matcher.get_error()
        assert matcher.is_accepting(), source
        parser = fmt.parser([FORCED, CLOCK])
        pieces = parser.feed(text) + parser.end()
        assert [p for p in pieces if isinstance(p, str)] == []
        [start] = [p for p in pieces if isinstance(p, CallStart)]
        arguments = "".join(p.text for p in pieces if isinstance(p, CallArguments))
        assert start.name == "get_weather"
        jsonschema.validate(json.loads(arguments), FORCED.parameters or {})

    @pytest.mark.parametrize("name", list(FORCED_TEXT))
    def test_the_grammar_refuses_a_call_outside_the_schema(
        self, name: str, tokenizer: Any
    ) -> None:
        # days=9 is over the maximum: no format's grammar may write it.
        source = TOOL_CALL_FORMATS[name].grammar([FORCED], False)
        matcher = llguidance.LLMatcher(
            tokenizer, llguidance.grammar_from("lark", source), log_level=0
        )
        text = FORCED_TEXT[name].replace("3", "9")
        accepted = matcher.consume_tokens(tokenizer.tokenize_str(text))
        assert not (accepted and matcher.is_accepting())

    @pytest.mark.parametrize("name", ["pythonic", "gemma4"])
    def test_objects_and_lists_are_forced_in_the_formats_own_literals(
        self, name: str, tokenizer: Any
    ) -> None:
        fmt = TOOL_CALL_FORMATS[name]
        source = fmt.grammar([PLAN], False)
        for text, accepted in PLAN_TEXT[name]:
            matcher = llguidance.LLMatcher(
                tokenizer, llguidance.grammar_from("lark", source), log_level=0
            )
            took = matcher.consume_tokens(tokenizer.tokenize_str(text))
            assert (took and matcher.is_accepting()) is accepted, text
            if not accepted:
                continue
            parser = fmt.parser([PLAN])
            pieces = parser.feed(text) + parser.end()
            arguments = "".join(p.text for p in pieces if isinstance(p, CallArguments))
            assert json.loads(arguments) == PLAN_ARGUMENTS
            jsonschema.validate(PLAN_ARGUMENTS, PLAN.parameters or {})

    @pytest.mark.parametrize("name", ["pythonic", "gemma4"])
    def test_a_string_pattern_cannot_be_forced_and_says_so(self, name: str) -> None:
        parameters = {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["code"],
        }
        with pytest.raises(UnforcedCallError, match=f"{name}.*'code'.*pattern"):
            TOOL_CALL_FORMATS[name].grammar([ToolSpec("get_code", parameters)], False)

    BOUNDS = ((MAX_FORCED_CALLS, True), (MAX_FORCED_CALLS + 1, False))

    @pytest.mark.parametrize(
        ("name", "between"), [("hermes", "\n"), ("llama3_json", "; ")]
    )
    def test_parallel_calls_end_at_the_bound(
        self, name: str, between: str, tokenizer: Any
    ) -> None:
        # A list that may go on forever never ends for a model that prefers
        # the separator: the grammar ends it after MAX_FORCED_CALLS calls.
        source = TOOL_CALL_FORMATS[name].grammar([FORCED], True)
        for count, accepted in (
            (MAX_FORCED_CALLS, True),
            (MAX_FORCED_CALLS + 1, False),
        ):
            matcher = llguidance.LLMatcher(
                tokenizer, llguidance.grammar_from("lark", source), log_level=0
            )
            text = between.join([FORCED_TEXT[name]] * count)
            took = matcher.consume_tokens(tokenizer.tokenize_str(text))
            assert (took and matcher.is_accepting()) is accepted, count

    def test_a_mistral_list_ends_at_the_bound(self, tokenizer: Any) -> None:
        source = TOOL_CALL_FORMATS["mistral"].grammar([FORCED], True)
        call = FORCED_TEXT["mistral"].removeprefix("[TOOL_CALLS] [").removesuffix("]")
        for count, accepted in (
            (MAX_FORCED_CALLS, True),
            (MAX_FORCED_CALLS + 1, False),
        ):
            matcher = llguidance.LLMatcher(
                tokenizer, llguidance.grammar_from("lark", source), log_level=0
            )
            text = "[TOOL_CALLS] [" + ", ".join([call] * count) + "]"
            took = matcher.consume_tokens(tokenizer.tokenize_str(text))
            assert (took and matcher.is_accepting()) is accepted, count
