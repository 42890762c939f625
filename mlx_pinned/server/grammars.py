"""Grammars compiled by llguidance, once for both sides: the HTTP side
compiles a request's grammar in a worker thread (a refusal is a 400), and
the engine takes it from the same cache on the MLX thread. Any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance

from .events import Grammar

__all__ = ["GRAMMARS", "GrammarCache", "GrammarCompileError"]


class GrammarCompileError(ValueError):
    """A grammar llguidance refuses; ``reason`` is llguidance's message."""

    def __init__(self, grammar: Grammar, reason: str) -> None:
        super().__init__(f"invalid {grammar.kind} grammar: {reason}")
        self.reason = reason


class GrammarCache:
    """The last ``kept`` compiled grammars, refusals included.

    Any thread: the lock guards the table, never a compile (two threads
    that miss the same grammar at once both compile it, to the same text).
    """

    def __init__(self, kept: int = 256) -> None:
        self.kept = kept
        self.compiles = 0
        self._lock = threading.Lock()
        # grammar -> (llguidance's grammar, why it is refused): one is empty.
        self._done: OrderedDict[Grammar, tuple[str, str]] = OrderedDict()

    def __contains__(self, grammar: object) -> bool:
        with self._lock:
            return grammar in self._done

    def compile(self, grammar: Grammar) -> str:
        """llguidance's grammar, compiled on first use. JSON is compact, so a
        constrained row cannot spend its tokens on blank space.

        Raises:
            GrammarCompileError: llguidance refuses the grammar.
        """
        with self._lock:
            done = self._done.get(grammar)
            if done is not None:
                self._done.move_to_end(grammar)
        if done is None:
            done = _compile(grammar)
            with self._lock:
                self.compiles += 1
                self._done[grammar] = done
                while len(self._done) > self.kept:
                    self._done.popitem(last=False)
        compiled, reason = done
        if reason:
            raise GrammarCompileError(grammar, reason)
        return compiled


GRAMMARS = GrammarCache()


def _compile(grammar: Grammar) -> tuple[str, str]:
    """llguidance's grammar and an empty reason, or "" and why it refuses."""
    compiler = llguidance.JsonCompiler(separators=(",", ":"), whitespace_pattern="")
    try:
        if grammar.kind == "json_schema":
            compiled = compiler.compile(grammar.source)
        elif grammar.kind == "json_object":
            compiled = compiler.compile('{"type": "object"}')
        elif grammar.kind == "regex":
            compiled = llguidance.RegexCompiler().compile(grammar.source)
        else:
            compiled = llguidance.LarkCompiler().compile(grammar.source)
    except Exception as exc:  # llguidance raises its own ValueError/RuntimeError
        return "", str(exc) or type(exc).__name__
    return str(compiled), llguidance.LLMatcher.validate_grammar(compiled)
