"""Speculative decoding with a draft model (engine/draft_model.py).

As for prompt lookup (test_speculative.py), every answer with a draft model
must be the answer without one: the same tokens, log-probabilities within
``TOL``. Three drafts of the tiny text model cover the paths a step takes: the
model itself (every draft kept, so each row feeds the draft model two
tokens at the next step), a model of another seed (almost every draft
refused) and the tiny vision model's language model (some kept, some not).
The draft model's own proposals are checked against its greedy continuation
of each row's history, run alone, so a cache that lost track of a row fails
even where the served model's verification hides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.config import ServerConfig
from mlx_pinned.server.config_checks import SettingError
from mlx_pinned.server.engine import (
    BatchEngine,
    DraftSettings,
    LoadedModel,
    draft_policy,
    load,
)
from mlx_pinned.server.engine.draft_model import DraftModel
from mlx_pinned.server.engine.rows import Row
from mlx_pinned.server.engine.sampling import vlm
from mlx_pinned.server.events import FinalEvent
from mlx_pinned.testing import make_tiny_lm, tiny_lm_path, tiny_vlm_path

from .conftest import MODEL, vision_body
from .kit import (
    TOL,
    Event,
    Request,
    Serve,
    interleaved,
    max_logprob_difference,
    request,
    scrape,
    value,
)

TEXT = {"sizes": (None,), "top_logprobs": 2}


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny text model with other random weights: the same tokenizer."""
    return make_tiny_lm(tmp_path_factory.mktemp("draft") / "seed-1", seed=1)


def engines(
    thread: MLXThread, loaded: LoadedModel, draft: Path, tokens: int = 4
) -> tuple[BatchEngine, BatchEngine]:
    """Two engines of one model: no speculation, and ``draft`` drafting."""

    def make() -> tuple[BatchEngine, BatchEngine]:
        on = BatchEngine(loaded, thread)
        on.speculate(DraftSettings(tokens=tokens, model=str(draft)))
        return BatchEngine(loaded, thread), on

    return thread.run_sync(make)


def assert_same(ours: list[list[Event]], theirs: list[list[Event]]) -> None:
    for mine, off in zip(ours, theirs, strict=True):
        assert max_logprob_difference(mine, off) <= TOL


def counts(engine: BatchEngine) -> tuple[int, int]:
    """Draft tokens verified, and kept; some were verified."""
    stats = engine.statistics()
    assert stats.speculative_steps > 0
    return stats.draft_tokens, stats.accepted_tokens


def mixed(count: int, max_tokens: int = 28) -> list[Request]:
    return [request(i, max_tokens + 3 * i, **TEXT) for i in range(count)]


class TestGreedyIsUnchanged:
    def test_the_model_as_its_own_draft_keeps_every_draft(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm, tiny_lm_path())
        reqs = mixed(3)
        batched = interleaved(thread, on, reqs, (0, 2, 5))
        assert_same(batched, [interleaved(thread, off, [r])[0] for r in reqs])
        drafted, kept = counts(on)
        assert kept == drafted > 0
        # A step keeps all four drafts and the model's own token: five tokens
        # a row and step, but where max_tokens leaves fewer.
        stats = on.statistics()
        assert stats.decoded_tokens > 4 * stats.speculative_rows

    @pytest.mark.slow
    @pytest.mark.parametrize("draft", ["other_seed", "vision"])
    def test_refused_drafts_change_nothing(
        self,
        thread: MLXThread,
        loaded_lm: LoadedModel,
        other_seed: Path,
        draft: str,
    ) -> None:
        path = other_seed if draft == "other_seed" else tiny_vlm_path()
        off, on = engines(thread, loaded_lm, path)
        reqs = mixed(4)
        batched = interleaved(thread, on, reqs, (0, 0, 3, 8))
        assert_same(batched, [interleaved(thread, off, [r])[0] for r in reqs])
        drafted, kept = counts(on)
        assert kept < drafted

    @pytest.mark.slow
    def test_a_vision_model_with_images_and_a_text_draft(
        self, thread: MLXThread
    ) -> None:
        vision = thread.run_sync(load, tiny_vlm_path())
        off, on = engines(thread, vision, tiny_lm_path())
        reqs = [request(i, 24, top_logprobs=2) for i in range(4)]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs, (0, 0, 4, 9)), alone)
        counts(on)

    def test_rows_that_cannot_draft_pause_it_and_it_catches_up(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        # A penalized row turns speculation off while it runs; the others'
        # draft caches fall behind and are prefilled again after it left.
        off, on = engines(thread, loaded_lm, tiny_lm_path())
        reqs = [request(0, 60, **TEXT), request(1, 8, presence_penalty=0.5, **TEXT)]
        batched = interleaved(thread, on, reqs, (0, 3))
        assert_same(batched, [interleaved(thread, off, [r])[0] for r in reqs])
        drafted, kept = counts(on)
        assert kept == drafted
        stats = on.statistics()
        assert stats.steps > stats.speculative_steps  # it did pause


class TestTheDraftCache:
    @pytest.mark.slow
    def test_proposals_are_the_draft_models_own_continuations(
        self,
        thread: MLXThread,
        loaded_lm: LoadedModel,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Each proposal equals the draft model's greedy continuation of the
        row's history run alone: rows joining, leaving, keeping some drafts
        (one pending token) and all of them (two). No row rests (the floor
        at 0), so every step drafts."""
        monkeypatch.setattr(draft_policy, "MODEL_FLOOR", 0.0)
        _, on = engines(thread, loaded_lm, tiny_vlm_path())
        seen: list[tuple[list[int], list[int]]] = []
        source = thread.run_sync(lambda: on._state.decoder.drafting.source)  # type: ignore[union-attr]
        assert isinstance(source, DraftModel)
        propose = source.propose

        def recording(rows: Sequence[Row], counts: Sequence[int]) -> list[list[int]]:
            drafts = propose(rows, counts)
            for row, d in zip(rows, drafts, strict=True):
                assert row.history is not None
                seen.append((row.history.ids.tolist(), d))
            return drafts

        source.propose = recording  # type: ignore[method-assign]
        reqs = mixed(5, 20)
        interleaved(thread, on, reqs, (0, 0, 2, 5, 9))
        drafted, kept = counts(on)
        assert 0 < kept < drafted
        assert len(seen) > 20

        def alone() -> list[list[int]]:
            return [greedy(source.lm, ids, len(d)) for ids, d in seen]

        assert [d for _, d in seen] == thread.run_sync(alone)

    def test_ids_the_served_model_lacks_are_never_drafted(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        reqs = mixed(3)

        def proposals(limit: int | None) -> tuple[list[int], BatchEngine]:
            off, on = engines(thread, loaded_lm, tiny_lm_path())
            source = thread.run_sync(lambda: on._state.decoder.drafting.source)  # type: ignore[union-attr]
            assert isinstance(source, DraftModel)
            if limit is not None:
                source.vocab_size = limit
            proposed: list[int] = []
            propose = source.propose

            def recording(
                rows: Sequence[Row], counts: Sequence[int]
            ) -> list[list[int]]:
                drafts = propose(rows, counts)
                proposed.extend(token for d in drafts for token in d)
                return drafts

            source.propose = recording  # type: ignore[method-assign]
            ours = interleaved(thread, on, reqs)
            assert_same(ours, interleaved(thread, off, reqs))
            return proposed, on

        everything, _ = proposals(None)
        # As if the served model's vocabulary ended below its largest draft.
        limit = max(everything)
        kept, engine = proposals(limit)
        assert kept
        assert max(kept) < limit
        counts(engine)

    @pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6])
    def test_max_tokens_is_exact(
        self, thread: MLXThread, loaded_lm: LoadedModel, max_tokens: int
    ) -> None:
        off, on = engines(thread, loaded_lm, tiny_lm_path())
        reqs = [request(i, max_tokens + i, **TEXT) for i in range(3)]
        batched = interleaved(thread, on, reqs)
        assert_same(batched, interleaved(thread, off, reqs))
        for i, events in enumerate(batched):
            final = events[-1]
            assert isinstance(final, FinalEvent)
            assert final.completion_tokens == max_tokens + i


def greedy(lm: Any, history: list[int], count: int) -> list[int]:
    """The draft model alone: ``count`` greedy tokens after ``history``."""
    cache = vlm().make_prompt_cache(lm)
    extra: dict[str, Any] = {}
    if hasattr(lm, "_rope_deltas"):  # as DraftModel gives it: text only
        extra["rope_deltas"] = mx.zeros((1, 1), dtype=mx.int32)
    logits = lm(mx.array([history], dtype=mx.uint32), cache=cache, **extra).logits
    out: list[int] = []
    for _ in range(count):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = lm(mx.array([[token]], dtype=mx.uint32), cache=cache, **extra).logits
    return out


class TestSampled:
    def test_seeded_rows_draw_the_same_tokens(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm, tiny_lm_path())
        kinds: list[dict[str, Any]] = [
            {"temperature": 0.4},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 0.5, "top_k": 5},
        ]
        reqs = [
            request(i, 24, seed=100 + i, **TEXT, **kind) for i, kind in enumerate(kinds)
        ]
        alone = [interleaved(thread, off, [req])[0] for req in reqs]
        assert_same(interleaved(thread, on, reqs, (0, 2, 4)), alone)
        counts(on)


class TestSettings:
    def test_the_settings_are_checked(self) -> None:
        with pytest.raises(SettingError, match="one of them"):
            ServerConfig(model="m", draft_model="d", prompt_lookup_tokens=2)
        with pytest.raises(SettingError, match="distributed"):
            ServerConfig(model="m", draft_model="d", distributed="tensor")
        with pytest.raises(SettingError, match="folder or hub id"):
            ServerConfig(model="m", draft_model=" ")
        with pytest.raises(ValueError, match="one of them"):
            DraftSettings(ngram=3, model="d")
        with pytest.raises(ValueError, match="one of them"):
            DraftSettings(model="d", mtp=True)

    def test_another_tokenizer_is_refused(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        engine = thread.run_sync(BatchEngine, loaded_lm, thread)
        settings = DraftSettings(model=str(tiny_lm_path("llama")))
        with pytest.raises(SettingError, match="tokenizer") as caught:
            thread.run_sync(engine.speculate, settings)
        assert caught.value.setting == "draft_model"

    def test_a_draft_whose_cache_cannot_be_cut_back_is_refused(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        engine = thread.run_sync(BatchEngine, loaded_lm, thread)
        settings = DraftSettings(model=str(tiny_vlm_path("qwen3_5")))
        with pytest.raises(SettingError, match="cut back"):
            thread.run_sync(engine.speculate, settings)

    def test_the_engine_counts_the_draft_models_weights(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        off, on = engines(thread, loaded_lm, tiny_vlm_path())
        draft = thread.run_sync(load, tiny_vlm_path())
        assert on.weight_bytes == off.weight_bytes + draft.weight_bytes


@pytest.mark.anyio
async def test_the_server_flag_drafts_and_the_metrics_show_it(serve: Serve) -> None:
    # The tiny vision model served, its own language model as the draft.
    async with serve(draft_model=str(tiny_vlm_path()), num_draft_tokens=3) as served:
        answer = await served.chat(vision_body(24, logprobs=True))
        assert answer.status_code == 200, answer.text
        samples = await scrape(served)
    async with serve() as served:
        plain = await served.chat(vision_body(24, logprobs=True))
        without = await scrape(served)
    assert answer.json()["choices"] == plain.json()["choices"]
    # The draft model's weights count with the model's: here, its own again.
    weights = value(samples, "mlx_pinned_model_weight_bytes", model=MODEL)
    assert weights == 2 * value(without, "mlx_pinned_model_weight_bytes", model=MODEL)
    assert value(samples, "mlx_pinned_speculative_steps_total", model=MODEL) > 0
    assert value(samples, "mlx_pinned_draft_tokens_total", model=MODEL) > 0
    assert value(samples, "mlx_pinned_decode_tokens_total", model=MODEL) == 23
