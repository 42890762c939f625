"""DFlash and EAGLE-3 drafting in the batch (engine/dflash_drafter.py,
engine/eagle3_drafter.py): a drafter of mlx-vlm's ``dflash`` or ``eagle3``
kind drafts for each row from the served Qwen3.5's hidden states at its
layers, kept by every forward pass; refused drafts are rolled back from the
gated delta-net's state. Greedy and seeded rows answer as without drafts,
alone and batched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.config_checks import SettingError
from mlx_pinned.server.engine import BatchEngine, DraftSettings, LoadedModel, load
from mlx_pinned.server.engine.dflash_drafter import DFlashDrafter
from mlx_pinned.server.engine.rows import Row
from mlx_pinned.testing import tiny_dflash_paths, tiny_eagle3_paths, tiny_vlm_path

from .kit import (
    TOL,
    critical,
    interleaved,
    max_logprob_difference,
    position_counts,
    tokens_of,
    two_sample_chi_square,
)
from .kit import assert_same_answers as assert_same
from .kit import drafting_engines as engines
from .kit import text_request as text

Pair = tuple[LoadedModel, DraftSettings]


WRITERS = {"dflash": tiny_dflash_paths, "eagle3": tiny_eagle3_paths}
# Each model's damping at which its drafter's drafts are kept some of the
# time, not always (the EAGLE-3 model has twice the layers to disagree).
PARTIAL = {"dflash": 0.4, "eagle3": 0.3}
# The damping at which seeded rows keep some drafts, not all.
SEEDED = {"dflash": 0.4, "eagle3": 0.1}
# The four-layer model's verify pass and its decode pass differ by more
# float error (with prompt lookup's drafts too), which a temperature below
# 1 scales up in the logprobs.
SEEDED_TOL = {"dflash": TOL, "eagle3": 1e-4}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def kind(request: pytest.FixtureRequest) -> str:
    found: str = request.param
    return found


def pair(thread: MLXThread, kind: str, damping: float) -> Pair:
    model, drafter = WRITERS[kind](damping)
    loaded: LoadedModel = thread.run_sync(load, model)
    return loaded, DraftSettings(model=str(drafter), tokens=3)


@pytest.fixture(scope="module")
def agreeing(thread: MLXThread, kind: str) -> Pair:
    """A drafter that agrees with its model on every token."""
    return pair(thread, kind, 0.05)


@pytest.fixture(scope="module")
def partial(thread: MLXThread, kind: str) -> Pair:
    """A drafter that agrees with its model on some of its tokens."""
    return pair(thread, kind, PARTIAL[kind])


def fed_of(state: Any) -> int:
    """Tokens a row's drafter state holds: a DFlash drafter cache's, or an
    EAGLE-3 drafter's less its last round's own drafts."""
    if isinstance(state, list):
        return int(state[0].offset)
    return int(state._cache[0].offset) - int(state._round_appended)


def source_of(engine: BatchEngine) -> DFlashDrafter:
    drafting = engine.loop.state.decoder.drafting
    assert drafting is not None
    assert isinstance(drafting.source, DFlashDrafter)
    return drafting.source


class TestDFlash:
    def test_an_agreeing_drafter_keeps_every_draft(
        self, thread: MLXThread, agreeing: Pair
    ) -> None:
        off, on = engines(thread, *agreeing)
        req = [text(0, 41)]
        assert_same(interleaved(thread, on, req), interleaved(thread, off, req))
        stats = on.statistics()
        assert stats.accepted_tokens == stats.draft_tokens > 0
        # The first step after the prefill has no hidden state to draft
        # from; every one after it gives a row 1 + 3 tokens.
        assert stats.speculative_steps <= 40 // 4 + 1

    def test_refused_drafts_roll_back_alone_and_batched(
        self, thread: MLXThread, partial: Pair
    ) -> None:
        off, on = engines(thread, *partial)
        reqs = [text(i, 32 + 4 * i) for i in range(3)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs[:1]), alone[:1])
        assert_same(interleaved(thread, on, reqs, (0, 3, 7)), alone)
        stats = on.statistics()
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        assert stats.peak_active >= 3

    def test_each_row_drafts_from_every_token_it_fed_once(
        self, thread: MLXThread, partial: Pair
    ) -> None:
        """The hidden states of plain and verify passes both reach the
        drafter: between two drafts, a row's context grows by the tokens it
        took, none lost and none twice, and holds each token it fed (the
        prompt's last, where the first decode step feeds it, and each
        answer token before its last)."""
        _, on = engines(thread, *partial)
        source = source_of(on)
        seen: dict[Row, set[int]] = {}
        propose = source.propose

        def counting(rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
            for row in rows:
                context = source.contexts.get(row)
                if context is not None:
                    fed = fed_of(context.state)
                    fed += sum(int(p.shape[1]) for p in context.pending)
                    seen.setdefault(row, set()).add(fed - row.sampled)
            return propose(rows, counts)

        source.propose = counting  # type: ignore[method-assign]
        interleaved(thread, on, [text(i, 30 + 5 * i) for i in range(3)], (0, 2, 5))
        assert len(seen) == 3
        assert all(gap in ({0}, {-1}) for gap in seen.values())

    def test_seeded_rows_draw_the_same_tokens(
        self, thread: MLXThread, kind: str
    ) -> None:
        off, on = engines(thread, *pair(thread, kind, SEEDED[kind]))
        kinds: list[dict[str, Any]] = [
            {"temperature": 0.4},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 0.5, "top_k": 5},
        ]
        reqs = [text(i, 32, seed=100 + i, **kind) for i, kind in enumerate(kinds)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        got = interleaved(thread, on, reqs, (0, 2, 4))
        assert [tokens_of(e) for e in got] == [tokens_of(e) for e in alone]
        for ours, theirs in zip(got, alone, strict=True):
            assert max_logprob_difference(ours, theirs) <= SEEDED_TOL[kind]
        stats = on.statistics()
        assert 0 < stats.accepted_tokens < stats.draft_tokens  # drawn off them

    def test_a_model_that_keeps_no_layer_states_is_refused(
        self, thread: MLXThread, agreeing: Pair
    ) -> None:
        loaded = thread.run_sync(load, tiny_vlm_path("qwen3_vl"))
        engine = thread.run_sync(BatchEngine, loaded, thread)
        with pytest.raises(SettingError, match="drafter, which drafts here only"):
            thread.run_sync(engine.speculate, agreeing[1])


@pytest.mark.slow
def test_kept_tokens_follow_the_target_distribution(
    thread: MLXThread, agreeing: Pair
) -> None:
    """test_speculative.py's two-sample chi-square, with DFlash drafts: the
    (position, token) counts of seeded rows, drafting against not, each over
    its own seeds."""
    off, on = engines(thread, *agreeing)
    draws, length = 96, 6

    def sample(engine: BatchEngine, seeds: range) -> Counter[tuple[int, ...]]:
        reqs = [
            text(0, length, temperature=1.0, seed=s, ignore_eos=True) for s in seeds
        ]
        return position_counts(thread, engine, reqs, length)

    ours = sample(on, range(draws))
    theirs = sample(off, range(draws, 2 * draws))
    stats = on.statistics()
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert len(theirs) > length  # not greedy in disguise
    statistic, bins = two_sample_chi_square(ours, theirs)
    assert statistic < critical(bins - 1)
