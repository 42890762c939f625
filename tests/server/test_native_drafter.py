"""Native drafters in the batch (engine/native_drafter.py): the MTP layers a
Qwen3.5 checkpoint carries, drafting for every row of the batch from the
model's last hidden state, its refused drafts rolled back from the gated
delta-net's state. Greedy and seeded rows answer as without drafts, alone
and batched.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.config import ModelSettings
from mlx_pinned.server.config_checks import SettingError
from mlx_pinned.server.engine import BatchEngine, DraftSettings, LoadedModel, load
from mlx_pinned.testing import tiny_assistant_paths, tiny_mtp_path, tiny_vlm_path

from .kit import assert_same_answers as assert_same
from .kit import (
    critical,
    drafting_engines,
    interleaved,
    position_counts,
    two_sample_chi_square,
)
from .kit import text_request as text

MTP = DraftSettings(mtp=True, tokens=3)


@pytest.fixture(scope="module")
def agreeing(thread: MLXThread) -> LoadedModel:
    """MTP layers that agree with their model on every token."""
    loaded: LoadedModel = thread.run_sync(load, tiny_mtp_path(0.05))
    return loaded


@pytest.fixture(scope="module")
def partial(thread: MLXThread) -> LoadedModel:
    """MTP layers that agree with their model on about 60 % of its tokens."""
    loaded: LoadedModel = thread.run_sync(load, tiny_mtp_path(0.3))
    return loaded


def engines(
    thread: MLXThread, loaded: LoadedModel, drafts: DraftSettings = MTP
) -> tuple[BatchEngine, BatchEngine]:
    return drafting_engines(thread, loaded, drafts)


class TestMTP:
    def test_agreeing_layers_keep_every_draft(
        self, thread: MLXThread, agreeing: LoadedModel
    ) -> None:
        off, on = engines(thread, agreeing)
        req = [text(0, 41)]
        assert_same(interleaved(thread, on, req), interleaved(thread, off, req))
        stats = on.statistics()
        assert stats.accepted_tokens == stats.draft_tokens > 0
        # The first step after the prefill has no hidden state to draft
        # from; every one after it gives a row 1 + 3 tokens.
        assert stats.speculative_steps <= 40 // 4 + 1

    def test_refused_drafts_roll_back_alone_and_batched(
        self, thread: MLXThread, partial: LoadedModel
    ) -> None:
        off, on = engines(thread, partial)
        reqs = [text(i, 32 + 4 * i) for i in range(3)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs[:1]), alone[:1])
        assert_same(interleaved(thread, on, reqs, (0, 3, 7)), alone)
        stats = on.statistics()
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        assert stats.peak_active >= 3

    def test_a_batch_past_the_bound_keeps_nothing_then_drafts_when_it_shrinks(
        self, thread: MLXThread, agreeing: LoadedModel
    ) -> None:
        off, on = engines(thread, agreeing, DraftSettings(mtp=True, max_batch=2))
        reqs = [text(0, 8), text(1, 40), text(2, 40)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs), alone)
        stats = on.statistics()
        assert stats.accepted_tokens > 0  # the two left after the first ended
        assert stats.speculative_rows <= 2 * stats.speculative_steps

    def test_seeded_rows_draw_the_same_tokens(
        self, thread: MLXThread, agreeing: LoadedModel
    ) -> None:
        off, on = engines(thread, agreeing)
        kinds: list[dict[str, Any]] = [
            {"temperature": 0.4},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 0.5, "top_k": 5},
        ]
        reqs = [text(i, 32, seed=100 + i, **kind) for i, kind in enumerate(kinds)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs, (0, 2, 4)), alone)
        stats = on.statistics()
        assert 0 < stats.accepted_tokens < stats.draft_tokens  # drawn off the drafts

    def test_a_checkpoint_without_mtp_layers_is_refused(
        self, thread: MLXThread
    ) -> None:
        loaded = thread.run_sync(load, tiny_vlm_path("qwen3_5"))
        engine = thread.run_sync(BatchEngine, loaded, thread)
        with pytest.raises(SettingError, match="carries no MTP layers"):
            thread.run_sync(engine.speculate, MTP)


@pytest.fixture(scope="module")
def assistant(thread: MLXThread) -> tuple[LoadedModel, DraftSettings]:
    """The tiny Gemma 4, damped, and an assistant that agrees with it."""
    model, drafter = tiny_assistant_paths(0.05)
    loaded: LoadedModel = thread.run_sync(load, model)
    return loaded, DraftSettings(model=str(drafter), tokens=3)


class TestAssistant:
    def test_it_drafts_for_the_batch_and_answers_as_without(
        self, thread: MLXThread, assistant: tuple[LoadedModel, DraftSettings]
    ) -> None:
        loaded, settings = assistant
        off, on = engines(thread, loaded, settings)
        reqs = [text(i, 24 + 4 * i) for i in range(3)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs[:1]), alone[:1])
        assert_same(interleaved(thread, on, reqs, (0, 3, 7)), alone)
        stats = on.statistics()
        assert stats.accepted_tokens > stats.draft_tokens // 2


class TestSettings:
    def test_a_checkpoint_with_mtp_layers_drafts_with_them_unless_told_not(
        self, thread: MLXThread
    ) -> None:
        path = tiny_mtp_path(0.05)

        def drafting(**settings: Any) -> DraftSettings | None:
            engine = BatchEngine.load(ModelSettings.of(path, **settings), thread)
            found = engine.loop.state.decoder.drafting
            return None if found is None else found.settings

        on = thread.run_sync(drafting)
        assert on is not None
        assert on.mtp
        assert (on.tokens, on.max_batch) == (3, 2)  # the server's defaults
        assert thread.run_sync(functools.partial(drafting, mtp=False)) is None
        lookup = thread.run_sync(functools.partial(drafting, prompt_lookup_tokens=2))
        assert lookup is not None
        assert (lookup.mtp, lookup.ngram) == (False, 2)


@pytest.mark.slow
def test_kept_tokens_follow_the_target_distribution(
    thread: MLXThread, agreeing: LoadedModel
) -> None:
    """test_speculative.py's two-sample chi-square, with MTP drafts: the
    (position, token) counts of seeded rows, drafting against not, each over
    its own seeds."""
    off, on = engines(thread, agreeing)
    draws, length = 96, 6

    def sample(engine: BatchEngine, seeds: range) -> Counter[tuple[int, ...]]:
        reqs = [
            text(0, length, temperature=1.0, seed=s, ignore_eos=True) for s in seeds
        ]
        return position_counts(thread, engine, reqs, length)

    ours = sample(on, range(draws))
    theirs = sample(off, range(draws, 2 * draws))
    stats = on.statistics()
    assert draws // 8 < stats.accepted_tokens < stats.draft_tokens
    assert len(theirs) > length  # not greedy in disguise
    statistic, bins = two_sample_chi_square(ours, theirs)
    assert statistic < critical(bins - 1)
