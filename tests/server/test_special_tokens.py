"""A forced call's grammar names a format's special-token markers as tokens."""

from __future__ import annotations

import llguidance

from mlx_pinned.server.engine.special_tokens import special_literals

SPECIALS = {"[TOOL_CALLS]": 5, "[ARGS]": 7, "<|channel|>": 200}


class TestSpecialLiterals:
    def test_a_grammar_without_special_tokens_is_unchanged(self) -> None:
        source = 'start: "<tool_call>" /[a-z]+/ "</tool_call>"'
        assert special_literals(source, SPECIALS) == source
        assert special_literals('start: "[TOOL_CALLS]"', {}) == 'start: "[TOOL_CALLS]"'

    def test_a_marker_literal_becomes_its_token(self) -> None:
        assert special_literals('start: "[TOOL_CALLS]"', SPECIALS) == "start: (<[5]>)"

    def test_markers_inside_a_literal_split_it_in_order(self) -> None:
        got = special_literals('call: "[TOOL_CALLS]get_weather[ARGS]" args', SPECIALS)
        assert got == 'call: (<[5]> "get_weather" <[7]>) args'

    def test_escapes_and_other_literals_are_kept(self) -> None:
        source = 'a: "say \\"hi\\"" "<|channel|>analysis" | "x"'
        got = special_literals(source, SPECIALS)
        assert got == 'a: "say \\"hi\\"" (<[200]> "analysis") | "x"'

    def test_the_longest_marker_wins(self) -> None:
        both = {"[TOOL": 1, "[TOOL_CALLS]": 5}
        assert special_literals('s: "[TOOL_CALLS]"', both) == "s: (<[5]>)"

    def test_the_rewritten_grammar_compiles(self) -> None:
        source = 'start: "[TOOL_CALLS]" "[" json "]"\njson: /[a-z]+/'
        rewritten = special_literals(source, SPECIALS)
        compiled = llguidance.LarkCompiler().compile(rewritten)
        assert not llguidance.LLMatcher.validate_grammar(compiled)
