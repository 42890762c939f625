"""Speculative decoding inside the batch (engine/drafting.py): prompt lookup.

Every test compares the engine with speculation on against the same engine
with it off, on the real tiny models. Greedy and seeded rows must give the
same tokens, token for token, with log-probabilities within ``TOL``; the
tests also check that drafts were verified and kept, so a run that never
speculated cannot pass.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.config import ServerConfig
from mlx_pinned.server.config_checks import SettingError
from mlx_pinned.server.engine import (
    BatchEngine,
    DraftSettings,
    LoadedModel,
    draft_policy,
)
from mlx_pinned.server.engine.draft_policy import FLOOR, REST, pace, resting
from mlx_pinned.server.engine.prompt_lookup import follow, lookup
from mlx_pinned.server.engine.rows import Row
from mlx_pinned.server.events import FinalEvent, SamplingParams, TokenEvent

from .conftest import MODEL, vision_body
from .kit import (
    TOL,
    Event,
    Request,
    Serve,
    critical,
    interleaved,
    max_logprob_difference,
    position_counts,
    request,
    scrape,
    two_sample_chi_square,
    value,
)

LOOKUP = DraftSettings(ngram=3, tokens=4)

# A prompt that repeats itself, and random weights that repeat themselves:
# prompt lookup finds drafts in both.
ECHO = ("one two three one two three one two three one two three",)


def engines(
    thread: MLXThread, loaded: LoadedModel, drafts: DraftSettings = LOOKUP
) -> tuple[BatchEngine, BatchEngine]:
    """Two engines of one model: speculation off, and on."""

    def make() -> tuple[BatchEngine, BatchEngine]:
        on = BatchEngine(loaded, thread)
        on.speculate(drafts)
        return BatchEngine(loaded, thread), on

    return thread.run_sync(make)


def assert_same(ours: list[list[Event]], theirs: list[list[Event]]) -> None:
    for mine, off in zip(ours, theirs, strict=True):
        assert max_logprob_difference(mine, off) <= TOL


def kept_drafts(engine: BatchEngine) -> int:
    stats = engine.statistics()
    assert stats.speculative_steps > 0
    assert stats.draft_tokens >= stats.accepted_tokens
    return stats.accepted_tokens


def echo(index: int, max_tokens: int, **params: Any) -> Request:
    params.setdefault("top_logprobs", 3)
    return request(index, max_tokens, prompts=ECHO, sizes=(None,), **params)


class TestPromptLookup:
    def test_drafts_continue_the_latest_match(self) -> None:
        ids = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2])
        assert lookup(ids, 3, 2) == [3, 7]  # "1 2" last seen before "3 7"

    def test_a_repeat_runs_past_the_end_as_its_period(self) -> None:
        assert lookup(np.array([4, 1, 2, 1, 2]), 2, 5) == [1, 2, 1, 2, 1]

    def test_the_longest_ngram_wins(self) -> None:
        ids = np.array([1, 2, 8, 0, 2, 9, 1, 2])
        assert lookup(ids, 2, 1) == [8]  # "1 2", not the later "2"
        assert lookup(ids, 1, 1) == [9]

    def test_nothing_recurs_nothing_drafted(self) -> None:
        assert lookup(np.array([1, 2, 3]), 3, 4) == []
        assert lookup(np.array([1, 1]), 3, 0) == []


class TestGreedyIsUnchanged:
    def test_solo_on_the_text_model(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm)
        req = [echo(0, 48)]
        assert_same(interleaved(thread, on, req), interleaved(thread, off, req))
        assert kept_drafts(on) > 0

    @pytest.mark.slow
    def test_batched_with_rows_joining_mid_decode(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm)
        text = {"sizes": (None,), "top_logprobs": 2}
        reqs = [echo(0, 40), request(3, 32, **text), echo(5, 24)]
        reqs.append(request(4, 36, **text))
        starts = (0, 3, 7, 12)
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        batched = interleaved(thread, on, reqs, starts)
        assert_same(batched, alone)
        assert kept_drafts(on) > 0
        assert on.statistics().peak_active >= 3

    @pytest.mark.slow
    def test_a_vision_model_with_images_batched(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded)
        reqs = [request(i, 32, top_logprobs=2) for i in range(4)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs, (0, 0, 4, 9)), alone)
        assert kept_drafts(on) > 0


class TestLimits:
    @pytest.mark.slow
    @pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 11])
    def test_max_tokens_is_exact(
        self, thread: MLXThread, loaded_lm: LoadedModel, max_tokens: int
    ) -> None:
        off, on = engines(thread, loaded_lm)
        reqs = [echo(i, max_tokens + i) for i in range(3)]
        batched = interleaved(thread, on, reqs)
        assert_same(batched, interleaved(thread, off, reqs))
        for i, events in enumerate(batched):
            final = events[-1]
            assert isinstance(final, FinalEvent)
            assert final.completion_tokens == max_tokens + i
            assert final.finish_reason == "length"

    def test_a_stop_string_inside_a_kept_run(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm)
        (plain,) = interleaved(thread, off, [echo(0, 40)])
        pieces = [e.text for e in plain if isinstance(e, TokenEvent)]
        # A stop string first seen well into the answer (speculating by then).
        text, early = "".join(pieces), len("".join(pieces[:8]))
        stop = next(
            stop
            for stop in (a + b for a, b in itertools.pairwise(pieces[8:]))
            if text.find(stop) >= early
        )
        reqs = [echo(0, 40, stop=(stop,)), echo(1, 40)]
        batched = interleaved(thread, on, reqs)
        assert_same(batched, interleaved(thread, off, reqs))
        final = batched[0][-1]
        assert isinstance(final, FinalEvent)
        assert final.finish_reason == "stop"
        assert final.stop_sequence == stop
        assert kept_drafts(on) > 0

    def test_a_batch_past_its_draft_bound_decodes_without_drafts(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off = BatchEngine(loaded_lm, thread)
        bounded = BatchEngine(loaded_lm, thread)
        thread.run_sync(bounded.speculate, dataclasses.replace(LOOKUP, max_batch=2))
        three = [echo(i, 24) for i in range(3)]
        assert_same(
            interleaved(thread, bounded, three), interleaved(thread, off, three)
        )
        stats = bounded.statistics()
        # No speculative step had all three rows (the last one alone may).
        assert stats.speculative_rows <= 2 * stats.speculative_steps
        assert stats.speculative_steps < stats.steps / 2
        # Alone, the same engine speculates.
        assert_same(
            interleaved(thread, bounded, three[:1]), interleaved(thread, off, three[:1])
        )
        assert kept_drafts(bounded) > 0

    def test_rows_that_cannot_draft_turn_speculation_off(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm)
        reqs = [echo(0, 24), echo(1, 24, presence_penalty=0.5)]
        reqs.append(echo(2, 24, repetition_penalty=1.2))
        assert_same(interleaved(thread, on, reqs), interleaved(thread, off, reqs))
        assert on.statistics().speculative_steps == 0

    def test_rows_with_bad_words_or_a_logit_bias_draft_and_answer_the_same(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm)
        (free,) = interleaved(
            thread, off, [echo(0, 32, return_tokens_as_token_ids=True)]
        )
        word = two_token_word(loaded_lm, free, 4)
        reqs = [echo(0, 32, bad_words=(word,)), echo(1, 32, logit_bias=((7, 2.0),))]
        batched = interleaved(thread, on, reqs)
        assert_same(batched, interleaved(thread, off, reqs))
        assert text_of(batched[0]) != text_of(free)  # the word was barred
        assert kept_drafts(on) > 0


class TestRunningAcceptance:
    def test_a_row_whose_drafts_miss_rests_and_comes_back(self) -> None:
        row = Row(max_tokens=512, sampling=SamplingParams())
        missed = 0
        while not resting(row):  # every draft missed: the share falls
            pace(row, 4, 0)
            missed += 1
        assert row.acceptance < FLOOR <= row.acceptance * 4 / 3
        assert 1 < missed < 20
        assert row.rest == REST
        row.sampled = row.rests_until
        assert not resting(row)
        pace(row, 4, 0)  # missed again: twice as long
        assert row.rest == 2 * REST
        assert resting(row)
        row.sampled = row.rests_until
        pace(row, 4, 4)  # all kept: back over the floor, the rest forgotten
        assert not resting(row)
        assert row.rest == 0
        share = row.acceptance
        pace(row, 0, 0)  # a step it drafted nothing in counts for nothing
        assert row.acceptance == share

    def test_hot_seeded_rows_verify_less_and_give_the_same_tokens(
        self,
        thread: MLXThread,
        loaded_lm: LoadedModel,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Hot sampling on random weights: prompt lookup's drafts are rarely
        # kept, so the rows rest; with the floor at 0 they never do.
        reqs = [
            request(i, 192, sizes=(None,), temperature=1.5, seed=i) for i in range(2)
        ]
        off, on = engines(thread, loaded_lm)
        _, never = engines(thread, loaded_lm)
        resting_runs = interleaved(thread, on, reqs)
        monkeypatch.setattr(draft_policy, "FLOOR", 0.0)
        always_runs = interleaved(thread, never, reqs)
        plain = interleaved(thread, off, reqs)
        assert_same(resting_runs, plain)
        assert_same(always_runs, plain)
        rests, always = on.statistics(), never.statistics()
        assert always.draft_tokens > 0
        assert always.accepted_tokens < always.draft_tokens / 4
        assert rests.speculative_steps < always.speculative_steps / 2


def two_token_word(loaded: LoadedModel, answer: list[Event], after: int) -> str:
    """A word ``answer`` (its tokens named by id) writes as two tokens in a
    row, past its first ``after``, that the word's text tokenizes back to."""
    ids = []
    for event in answer:
        if isinstance(event, TokenEvent):
            assert event.logprobs is not None
            ids.append(int(event.logprobs.token.removeprefix("token_id:")))
    encode, decode = loaded.tokenizer.encode, loaded.tokenizer.decode
    word: str = next(
        text
        for i in range(after, len(ids) - 1)
        if ids[i] != ids[i + 1]
        and encode(text := decode(ids[i : i + 2]).lstrip()) == ids[i : i + 2]
    )
    return word


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent)) + (
        events[-1].text if isinstance(events[-1], FinalEvent) else ""
    )


def edited(text: str) -> str:
    """``text`` with a few of its characters changed mid-way (an edit)."""
    middle = len(text) // 2
    return text[:middle] + "zq" + text[middle + 2 :]


class TestPredictions:
    def test_follow_keeps_an_edit_in_place(self) -> None:
        prediction = np.array([5, 6, 7, 8, 5, 6, 9, 10])
        # [5, 6] is at 0 and at 4: the match nearest the answer's length.
        assert follow(prediction, np.array([1, 2, 3, 4, 5, 6]), 8, 2) == [9, 10]
        assert follow(prediction, np.array([5, 6]), 8, 2) == [7, 8]
        assert follow(prediction, np.array([], dtype=np.int64), 8, 3) == [5, 6, 7]
        assert follow(prediction, np.array([42]), 8, 3) == []

    def test_an_edited_prediction_gives_the_same_answer(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        # No prompt lookup: a prediction drafts on its own.
        plain, predicted = (
            BatchEngine(loaded_lm, thread),
            BatchEngine(loaded_lm, thread),
        )
        alone = interleaved(thread, plain, [echo(0, 48)])
        guess = edited(text_of(alone[0]))
        with_it = interleaved(thread, predicted, [echo(0, 48, prediction=guess)])
        assert_same(with_it, alone)
        final = with_it[0][-1]
        assert isinstance(final, FinalEvent)
        assert final.accepted_prediction_tokens > 10
        assert final.rejected_prediction_tokens > 0  # the edit was refused
        assert kept_drafts(predicted) == final.accepted_prediction_tokens

    def test_a_prediction_beside_bad_words_is_used_and_the_words_barred(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        plain, predicted = (
            BatchEngine(loaded_lm, thread),
            BatchEngine(loaded_lm, thread),
        )
        (free,) = interleaved(
            thread, plain, [echo(0, 48, return_tokens_as_token_ids=True)]
        )
        word = two_token_word(loaded_lm, free, 8)
        alone = interleaved(thread, plain, [echo(0, 48, bad_words=(word,))])
        # The prediction drafts the word: each draft is barred as a one-token
        # step bars it, from the tokens (drafts too) before it.
        guess = text_of(free)
        assert text_of(alone[0]) != guess
        reqs = [echo(0, 48, bad_words=(word,), prediction=guess)]
        with_it = interleaved(thread, predicted, reqs)
        assert_same(with_it, alone)
        final = with_it[0][-1]
        assert isinstance(final, FinalEvent)
        assert final.accepted_prediction_tokens > 5
        assert final.rejected_prediction_tokens > 0  # the word, at least

    def test_a_row_with_a_prediction_beside_one_without(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        plain, predicted = (
            BatchEngine(loaded_lm, thread),
            BatchEngine(loaded_lm, thread),
        )
        reqs = [echo(0, 40), echo(1, 40)]
        alone = [interleaved(thread, plain, [req])[0] for req in reqs]
        guess = text_of(alone[0])
        both = [echo(0, 40, prediction=guess), echo(1, 40)]
        assert_same(interleaved(thread, predicted, both), alone)
        assert kept_drafts(predicted) > 10


@pytest.mark.slow
class TestSampled:
    def test_seeded_rows_draw_the_same_tokens(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        # Each kept token is the target's own draw with its position's key.
        off, on = engines(thread, loaded_lm)
        kinds: list[dict[str, Any]] = [
            {"temperature": 0.4},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 0.5, "top_k": 5},
            {"temperature": 0.6, "min_p": 0.1},
        ]
        reqs = [echo(i, 32, seed=100 + i, **kind) for i, kind in enumerate(kinds)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs, (0, 2, 4, 6)), alone)
        assert kept_drafts(on) > 0

    def test_kept_tokens_follow_the_target_distribution(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        """Two-sample chi-square of (position, token) over the positions the
        speculative steps give (the first token is the prefill's),
        speculation on against off, each over its own seeds (so the
        same-key identity above plays no part)."""
        off, on = engines(thread, loaded_lm)
        draws, length = 96, 6

        def sample(engine: BatchEngine, seeds: range) -> Counter[tuple[int, ...]]:
            reqs = [echo(0, length, temperature=0.5, seed=s) for s in seeds]
            return position_counts(thread, engine, reqs, length)

        ours = sample(on, range(draws))
        theirs = sample(off, range(draws, 2 * draws))
        assert kept_drafts(on) > draws // 8
        assert len(theirs) > 1  # the position is not greedy in disguise
        statistic, bins = two_sample_chi_square(ours, theirs)
        assert statistic < critical(bins - 1)


class TestSettings:
    def test_the_flags_are_checked(self) -> None:
        with pytest.raises(SettingError, match="num_draft_tokens"):
            ServerConfig(model="m", prompt_lookup_tokens=2, num_draft_tokens=0)
        with pytest.raises(SettingError, match="prompt_lookup_tokens"):
            ServerConfig(model="m", prompt_lookup_tokens=-1)
        with pytest.raises(SettingError, match="distributed"):
            ServerConfig(model="m", prompt_lookup_tokens=2, distributed="tensor")

    def test_the_counts_reach_the_engine_counters(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        _, on = engines(thread, loaded_lm)
        interleaved(thread, on, [echo(0, 32)])
        counters = on.counters()
        assert counters.speculative_steps > 0
        assert counters.decoded_tokens == 31  # the first token is the prefill's
        assert counters.decode_steps < counters.decoded_tokens
        assert 0 < counters.accepted_tokens <= counters.draft_tokens


@pytest.mark.anyio
async def test_the_server_flag_speculates_and_the_metrics_show_it(
    serve: Serve,
) -> None:
    async with serve(prompt_lookup_tokens=3, num_draft_tokens=4) as served:
        plain = await served.chat(vision_body(48, logprobs=True))
        assert plain.status_code == 200, plain.text
        samples = await scrape(served)
    usage = plain.json()["usage"]
    assert usage["completion_tokens"] == 48
    assert value(samples, "mlx_pinned_speculative_steps_total", model=MODEL) > 0
    assert value(samples, "mlx_pinned_draft_accepted_tokens_total", model=MODEL) > 0
    assert 0 < value(samples, "mlx_pinned_draft_acceptance_ratio", model=MODEL) <= 1
    assert value(samples, "mlx_pinned_speculative_tokens_per_step", model=MODEL) > 1
    assert value(samples, "mlx_pinned_decode_tokens_total", model=MODEL) == 47
