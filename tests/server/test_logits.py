"""Penalties and grammars: per row, exact, and batched without cross-talk.

The definitions are checked on small logits; then real rows of the tiny
model: a row with a penalty or a grammar, batched with free rows, gives the
same tokens and log-probabilities (``TOL``) as alone, and so do the free
rows; the grammar's output always parses and validates.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel, logits
from mlx_pinned.server.engine.logits import penalize, prompt_seen
from mlx_pinned.server.engine.speculation import SPECULATION_MISSES, Speculation
from mlx_pinned.server.engine.state import BatchState
from mlx_pinned.server.events import FinalEvent, Grammar, SamplingParams
from mlx_pinned.server.failures import InvalidGrammarError
from mlx_pinned.server.grammars import GRAMMARS
from mlx_pinned.testing import tiny_vlm_path

from .kit import (
    TOL,
    Event,
    Request,
    all_at_once,
    drive_rows,
    max_logprob_difference,
    request,
    tokens,
)

pytestmark = pytest.mark.anyio

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


class Row:
    """What the penalties read of a row: ``(presence, frequency,
    repetition)``, its counts and its prompt's tokens."""

    def __init__(
        self, penalties: tuple[float, float, float], seen: mx.array | None = None
    ) -> None:
        presence, frequency, repetition = penalties
        self.sampling = SamplingParams(
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
        )
        self.counts: mx.array | None = None
        self.seen = seen


class TestPenaltyDefinitions:
    def test_presence_and_frequency_as_openai_defines_them(
        self, thread: MLXThread
    ) -> None:
        def run() -> list[list[float]]:
            logits = mx.array([[1.0, 2.0, -1.0, 0.5]])
            row = Row((0.5, 0.25, 1.0))
            first = penalize(logits, [row], mx.array([1]), [True])
            penalize(logits, [row], mx.array([1]), [True])  # token 1 again
            third = penalize(logits, [row], mx.array([2]), [True])
            return [first[0].tolist(), third[0].tolist()]

        first, third = thread.run_sync(run)
        # mu[j] - c[j] * frequency - (c[j] > 0) * presence
        assert first == pytest.approx([1.0, 2.0 - 0.25 - 0.5, -1.0, 0.5])
        assert third == pytest.approx([1.0, 2.0 - 0.5 - 0.5, -1.0 - 0.75, 0.5])

    def test_repetition_divides_positive_and_multiplies_negative_logits(
        self, thread: MLXThread
    ) -> None:
        def run() -> list[float]:
            row = Row((0.0, 0.0, 2.0), seen=prompt_seen(mx.array([[0, 2]]), 4))
            logits = mx.array([[1.0, 2.0, -1.0, 0.5]])
            out: list[float] = penalize(logits, [row])[0].tolist()
            return out

        assert thread.run_sync(run) == pytest.approx([0.5, 2.0, -2.0, 0.5])

    def test_a_prompt_token_not_generated_is_not_counted(
        self, thread: MLXThread
    ) -> None:
        def run() -> list[float]:
            logits = mx.array([[1.0, 2.0]])
            row = Row((1.0, 1.0, 1.0))
            out: list[float] = penalize(logits, [row], mx.array([1]), [False])[
                0
            ].tolist()
            return out

        assert thread.run_sync(run) == [1.0, 2.0]

    def test_rows_without_penalties_are_untouched_bit_for_bit(
        self, thread: MLXThread
    ) -> None:
        def run() -> bool:
            logits = mx.random.normal((3, 50), key=mx.random.key(0))
            rows = [Row((0.0, 0.0, 1.0)), Row((1.5, 0.5, 1.3)), Row((0.0, 0.0, 1.0))]
            out = penalize(logits, rows, mx.array([3, 4, 5]), [True] * 3)
            same = mx.array_equal(out[0], logits[0]) and mx.array_equal(
                out[2], logits[2]
            )
            return bool(same) and not bool(mx.array_equal(out[1], logits[1]))

        assert thread.run_sync(run)


async def alone(thread: MLXThread, loaded: LoadedModel, req: Request) -> list[Event]:
    """The request alone in an engine of its own."""
    async with BatchEngine(loaded, thread).stream(*req) as stream:
        return [event async for event in stream]


async def together(
    thread: MLXThread, loaded: LoadedModel, reqs: list[Request]
) -> list[list[Event]]:
    batch = BatchEngine(loaded, thread)
    runs = await all_at_once(thread, batch, reqs)
    assert batch.statistics().peak_active > 1
    return [run.events for run in runs]


def text(events: list[Event]) -> str:
    return "".join(event.text for event in events)


class TestPenaltiesInTheBatch:
    async def test_penalties_change_the_answer_and_stay_on_their_row(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        free = request(4, 24)  # no image: the demo model repeats itself
        penalized = [
            request(4, 24, presence_penalty=1.5),
            request(4, 24, frequency_penalty=1.0),
            request(4, 24, repetition_penalty=1.4),
            request(1, 16, presence_penalty=0.7, frequency_penalty=0.3, top_k=5),
        ]
        expected = [await alone(thread, loaded, r) for r in [free, *penalized]]
        plain = text(expected[0])
        assert all(text(events) != plain for events in expected[1:4])
        # Repeated tokens become rarer under a penalty.
        distinct = [
            len({e.logprobs.token for e in tokens(ev) if e.logprobs})
            for ev in expected[:4]
        ]
        assert min(distinct[1:]) > distinct[0]
        batched = await together(thread, loaded, [free, *penalized])
        for ours, theirs in zip(batched, expected, strict=True):
            assert max_logprob_difference(ours, theirs) <= TOL


class TestGrammarInTheBatch:
    @pytest.mark.slow
    async def test_schema_rows_validate_and_free_rows_do_not_notice(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        grammar = Grammar("json_schema", json.dumps(SCHEMA))
        reqs = [
            request(0, 60, grammar=grammar),
            request(1, 20),
            request(2, 60, grammar=Grammar("json_object"), top_logprobs=2),
            request(3, 20, temperature=1.0, seed=3),
            request(5, 60, grammar=grammar, temperature=1.0, seed=9),
        ]
        expected = [await alone(thread, loaded, r) for r in reqs]
        batched = await together(thread, loaded, reqs)
        for ours, theirs in zip(batched, expected, strict=True):
            assert max_logprob_difference(ours, theirs) <= TOL
        for i in (0, 4):
            final = batched[i][-1]
            assert isinstance(final, FinalEvent)
            assert final.finish_reason == "stop"
            jsonschema.validate(json.loads(text(batched[i])), SCHEMA)
        final = batched[2][-1]
        assert isinstance(final, FinalEvent)
        if final.finish_reason == "stop":  # else cut short by max_tokens
            assert isinstance(json.loads(text(batched[2])), dict)
        else:
            assert text(batched[2]).startswith("{")
        # A masked token never reaches the answer: every chosen token was
        # allowed, so its log-probability is finite.
        for events in batched:
            for event in tokens(events):
                assert event.logprobs is not None
                assert math.isfinite(event.logprobs.logprob)

    async def test_a_schema_cut_by_max_tokens_ends_with_length(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        grammar = Grammar("json_schema", json.dumps(SCHEMA))
        events = await alone(thread, loaded, request(0, 3, grammar=grammar))
        final = events[-1]
        assert isinstance(final, FinalEvent)
        assert final.finish_reason == "length"
        assert text(events).startswith('{"')

    async def test_an_invalid_grammar_is_a_400_before_prefill(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        bad = Grammar("json_schema", '{"type": "no-such-type"}')
        batch = BatchEngine(loaded, thread)
        with pytest.raises(InvalidGrammarError) as caught:
            async with batch.stream(*request(0, 4, grammar=bad)) as stream:
                [event async for event in stream]
        assert caught.value.code == "invalid_grammar"
        assert batch.statistics().prefills == 0

    async def test_a_request_gets_a_copy_of_the_one_matcher_kept_per_grammar(
        self,
        thread: MLXThread,
        loaded: LoadedModel,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setattr(logits, "MATCHERS_KEPT", 2)
        grammar = Grammar("json_schema", json.dumps(SCHEMA))

        def run() -> tuple[bool, bool, list[Grammar]]:
            loaded.grammar_matchers.clear()
            first = logits.new_matcher(loaded, grammar)
            second = logits.new_matcher(loaded, grammar)
            allowed = logits.fill_masks([first], loaded.vocab_size)
            assert allowed is not None
            token = int(allowed[0].argmax())  # the first token it allows
            first.consume(token)
            # The second copy and the kept one are still at the start.
            still = logits.fill_masks(
                [second, loaded.grammar_matchers[grammar]], loaded.vocab_size
            )
            assert still is not None
            moved = logits.fill_masks([first], loaded.vocab_size)
            assert moved is not None
            others = [
                Grammar("json_schema", json.dumps({"type": kind}))
                for kind in ("integer", "boolean")
            ]
            for other in others:
                logits.new_matcher(loaded, other)
            return (
                bool(still[:, token].all()),
                bool((moved[0] == allowed[0]).all()),
                list(loaded.grammar_matchers),
            )

        untouched, same, kept = await thread.run(run)
        assert untouched
        assert not same  # the consumed copy moved on
        assert kept == [  # the least recently used one left
            Grammar("json_schema", json.dumps({"type": kind}))
            for kind in ("integer", "boolean")
        ]

    async def test_a_matcher_takes_the_grammar_the_http_side_compiled(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        grammar = Grammar("json_schema", json.dumps({"type": "integer", "maximum": 7}))
        GRAMMARS.compile(grammar)  # the HTTP side's check, on a worker thread
        before = GRAMMARS.compiles
        await thread.run(loaded.grammar_matchers.clear)
        await thread.run(logits.new_matcher, loaded, grammar)
        assert GRAMMARS.compiles == before
        assert grammar in await thread.run(dict, loaded.grammar_matchers)

    async def test_a_grammar_spelling_a_special_token_is_kept_as_asked(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # Rewritten to name the token (<[2]>) before it is compiled, and
        # found again by the grammar the request sent.
        grammar = Grammar("lark", 'start: "ok" "<|im_end|>"')

        def twice() -> list[Grammar]:
            loaded.grammar_matchers.clear()
            logits.new_matcher(loaded, grammar)
            before = GRAMMARS.compiles
            logits.new_matcher(loaded, grammar)
            assert GRAMMARS.compiles == before
            return list(loaded.grammar_matchers)

        assert await thread.run(twice) == [grammar]


class TestGrammarSpeculation:
    """A row that reads no log-probabilities is drawn without its grammar's
    mask and checked after (``speculates``); where its grammar refuses the
    token, it is drawn again masked and the next step built again. Its
    answer must be the masked row's, token for token."""

    @pytest.mark.slow
    async def test_a_row_drawn_without_its_mask_answers_as_a_masked_one(
        self,
        thread: MLXThread,
        loaded: LoadedModel,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        calls = {"speculative": 0, "rebuild": 0}
        for name, attribute in (("speculative", "pick"), ("rebuild", "rebuild")):
            method = getattr(Speculation, attribute)

            def counted(*args: Any, _m: Any = method, _n: str = name) -> Any:
                result = _m(*args)
                calls[_n] += bool(result) if _n == "speculative" else 1
                return result

            monkeypatch.setattr(Speculation, attribute, counted)
        grammar = Grammar("json_schema", json.dumps(SCHEMA))
        options: list[dict[str, Any]] = [
            {"grammar": grammar},
            {"grammar": grammar, "temperature": 1.0, "seed": 9},
            {"grammar": grammar, "frequency_penalty": 0.8, "presence_penalty": 0.3},
            {"grammar": Grammar("json_object"), "frequency_penalty": 0.4},
            {"grammar": Grammar("json_object"), "repetition_penalty": 1.3},
        ]
        masked = [request(i, 48, logprobs=True, **o) for i, o in enumerate(options)]
        drawn = [request(i, 48, logprobs=False, **o) for i, o in enumerate(options)]
        expected = [await alone(thread, loaded, r) for r in masked]
        assert calls == {"speculative": 0, "rebuild": 0}  # all masked
        solo = [await alone(thread, loaded, r) for r in drawn]
        # The random weights pick control bytes inside strings, which JSON
        # refuses: the checked path was taken, and the path that corrects it.
        assert calls["speculative"] > 0
        assert calls["rebuild"] > 0
        batched = await together(thread, loaded, [*drawn, request(1, 20)])
        for ours in (solo, batched[: len(drawn)]):
            for events, theirs in zip(ours, expected, strict=True):
                assert [e.text for e in tokens(events)] == [
                    e.text for e in tokens(theirs)
                ]
                assert events[-1] == theirs[-1]  # text, finish, token counts
        jsonschema.validate(json.loads(text(batched[0])), SCHEMA)

    async def test_rows_joining_a_speculating_batch_answer_as_alone(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # Rows join while others speculate, so steps are cut back and built
        # again with joiners in them, and joiners are refused in turn.
        grammar = Grammar("json_schema", json.dumps(SCHEMA))
        bias = ((5, 2.0), (7, -3.0))
        reqs = [
            request(i, 40, logprobs=False, grammar=grammar, logit_bias=bias)
            for i in range(4)
        ]

        def drive(reqs: list[Request], joins: list[int]) -> list[list[int]]:
            return drive_rows(BatchState(loaded), reqs, joins)

        def run() -> tuple[list[list[int]], list[list[int]], int]:
            solo = [drive([req], [0])[0] for req in reqs]
            rebuilt = 0
            method = Speculation.rebuild

            def counted(self: Speculation, *args: Any) -> Any:
                nonlocal rebuilt
                rebuilt += 1
                return method(self, *args)

            Speculation.rebuild = counted  # type: ignore[method-assign]
            try:
                staggered = drive(reqs, [0, 3, 7, 12])
            finally:
                Speculation.rebuild = method  # type: ignore[method-assign]
            return solo, staggered, rebuilt

        solo, staggered, rebuilt = await thread.run(run)
        assert staggered == solo
        assert rebuilt > 0

    async def test_a_batch_whose_caches_cannot_be_cut_back_masks_every_row(
        self, thread: MLXThread, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Gemma 3's sliding-window layers keep rotating caches: no step of
        # its batch can be built again, so no row may speculate.
        gemma: LoadedModel = await thread.run(engine.load, tiny_vlm_path("gemma3"))
        picked: list[list[int]] = []
        method = Speculation.pick

        def spied(self: Speculation, rows: list[Any], caches: Any) -> list[int]:
            picked.append(method(self, rows, caches))
            return picked[-1]

        monkeypatch.setattr(Speculation, "pick", spied)
        grammar = Grammar("json_schema", json.dumps(SCHEMA))
        reqs = [request(i, 40, logprobs=False, grammar=grammar) for i in range(3)]
        answers = await together(thread, gemma, reqs)
        assert picked
        assert not any(picked)
        for events in answers:
            final = events[-1]
            assert isinstance(final, FinalEvent)
            if final.finish_reason == "stop":
                jsonschema.validate(json.loads(text(events)), SCHEMA)
            else:
                assert text(events).startswith('{"')

    async def test_a_batch_whose_rows_are_often_refused_stops_speculating(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        grammar = Grammar("json_schema", json.dumps(SCHEMA))

        def run() -> tuple[list[int], list[int], list[int]]:
            state = BatchState(loaded)
            rows = [
                state.admit(*request(i, 30, logprobs=False, grammar=grammar))
                for i in range(2)
            ]
            while not state.rows or any(not r.sampled for r in rows):
                state.step()
            assert not any(r.done for r in rows)
            # Rows inside a string, their grammar leaving the choice open.
            while any(r.matcher is not None and r.matcher.forced() for r in rows):
                state.step()
            speculation = state.decoder.speculation
            assert speculation is not None  # the CPU backend
            cache = state.cache or ()
            before = speculation.pick(state.rows, cache)
            speculation.window.extend([True] * (SPECULATION_MISSES + 1))
            paused = [len(speculation.pick(state.rows, cache)) for _ in range(3)]
            speculation.paused = 0
            after = speculation.pick(state.rows, cache)
            return before, paused, after

        before, paused, after = await thread.run(run)
        assert before == [0, 1]
        assert paused == [0, 0, 0]
        assert after == [0, 1]  # the window was cleared
