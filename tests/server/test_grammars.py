"""The one grammar compiler and its cache, shared by the HTTP check and the
engine: each grammar compiled once, a refusal remembered, the table bounded,
on any thread."""

from __future__ import annotations

import json
import threading

import pytest

from mlx_pinned.server.events import Grammar
from mlx_pinned.server.grammars import GrammarCache, GrammarCompileError


def schema(kind: str) -> Grammar:
    return Grammar("json_schema", json.dumps({"type": kind}))


class TestGrammarCache:
    def test_a_grammar_is_compiled_once(self) -> None:
        cache = GrammarCache()
        first = cache.compile(schema("integer"))
        assert cache.compile(schema("integer")) == first
        assert cache.compiles == 1
        assert schema("integer") in cache

    def test_json_is_compiled_compactly(self) -> None:
        compiled = json.loads(GrammarCache().compile(schema("object")))
        options = compiled["grammars"][0]["json_schema"]["x-guidance"]
        assert options["whitespace_pattern"] == ""
        assert options["item_separator"] == ","

    def test_a_refusal_is_remembered_and_raised_each_time(self) -> None:
        cache = GrammarCache()
        bad = Grammar("lark", "start: undefined_rule")
        for _ in range(2):
            with pytest.raises(GrammarCompileError) as caught:
                cache.compile(bad)
            assert caught.value.reason
            assert str(caught.value).startswith("invalid lark grammar: ")
        assert cache.compiles == 1

    def test_it_keeps_the_last_used(self) -> None:
        cache = GrammarCache(kept=2)
        for kind in ("integer", "boolean", "integer", "string"):
            cache.compile(schema(kind))
        assert schema("integer") in cache
        assert schema("string") in cache
        assert schema("boolean") not in cache

    def test_threads_share_it(self) -> None:
        cache = GrammarCache()
        cache.compile(schema("number"))
        threads = [
            threading.Thread(target=cache.compile, args=(schema("number"),))
            for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert cache.compiles == 1
