"""A verify pass and its rollback (engine/verify_pass.py): on a hybrid model
(Qwen3.5's gated delta-net) and a sliding-window one (Gemma 3), refused
drafts are taken back exactly, so prompt lookup and predictions draft on
them and answer as without drafts, alone and batched.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, DraftSettings, LoadedModel, load
from mlx_pinned.server.engine.model_inputs import Prepared
from mlx_pinned.server.engine.prefill import ChunkedPrefill
from mlx_pinned.server.engine.quirks import rope_deltas
from mlx_pinned.server.engine.verify_pass import Rollback, rollback_of, verify
from mlx_pinned.server.events import FinalEvent, TokenEvent
from mlx_pinned.testing import tiny_lm_path, tiny_vlm_path

from .kit import TOL, Event, interleaved, max_logprob_difference, request

ECHO = ("one two three one two three one two three one two three",)
LOOKUP = DraftSettings(ngram=3, tokens=4)


@pytest.fixture(scope="module", params=["qwen3_5", "gemma3"])
def family(request: pytest.FixtureRequest, thread: MLXThread) -> LoadedModel:
    loaded: LoadedModel = thread.run_sync(load, tiny_vlm_path(request.param))
    return loaded


def echo(index: int, max_tokens: int, **params: object) -> tuple[object, list[object]]:
    params.setdefault("top_logprobs", 3)
    return request(index, max_tokens, prompts=ECHO, sizes=(None,), **params)


def test_each_cache_kind_has_its_rollback(thread: MLXThread) -> None:
    paths = (tiny_lm_path(), tiny_vlm_path("gemma3"), tiny_vlm_path("qwen3_5"))

    def kinds() -> list[Rollback | None]:
        return [rollback_of(load(path).model.language_model) for path in paths]

    assert thread.run_sync(kinds) == [
        Rollback.CUT,
        Rollback.WINDOWED,
        Rollback.RECURRENT,
    ]


class _ChunkedLayers:
    """A language model's cache factory of a kind no rollback knows
    (Llama 4's chunked attention), for :func:`rollback_of` alone."""

    def make_cache(self) -> list[object]:
        from mlx_vlm.models.cache import ChunkedKVCache, KVCache

        return [KVCache(), ChunkedKVCache(8)]


def test_a_cache_no_rollback_knows_refuses_drafting() -> None:
    assert rollback_of(_ChunkedLayers()) is None


def test_a_ragged_commit_leaves_each_row_as_if_fed_its_kept_tokens(
    thread: MLXThread, family: LoadedModel
) -> None:
    """Rows keep 1 and 3 of 3 drafts; then each row's next logits equal those
    of its cache fed only what it kept, alone."""
    lm = family.model.language_model
    prompts = [list(range(10, 40)), list(range(50, 65))]
    drafts = [[30, 31, 32, 33], [40, 41, 42, 43]]
    kept = [1, 3]
    after = [[60, 61], [70, 71]]

    def kwargs(rows: int) -> dict[str, object]:
        deltas = rope_deltas(lm, {}, rows)  # Qwen-VL: none kept on the model
        return {} if deltas is None else {"rope_deltas": deltas}

    def alone(prompt: list[int], fed: list[int]) -> mx.array:
        cache = prefilled(prompt)
        lm(mx.array([fed]), cache=cache, **kwargs(1))
        ids = mx.array([after[prompts.index(prompt)]])
        return lm(ids, cache=cache, **kwargs(1)).logits[0]

    def prefilled(prompt: list[int]) -> list[object]:
        job = ChunkedPrefill(family, prepared(prompt))
        while (group := job.advance()) is None:
            pass
        return group.cache

    def prepared(prompt: list[int]) -> Prepared:
        return Prepared({"input_ids": mx.array([prompt])}, len(prompt), prompt[-1])

    def run() -> float:
        caches = [prefilled(p) for p in prompts]
        batch = caches[0]
        for mine, theirs in zip(batch, caches[1], strict=True):
            mine.extend(theirs)
        rollback = rollback_of(lm)
        assert rollback is not None
        step = verify(lm, rollback, mx.array(drafts), batch, kwargs(2))
        step.commit(kept)
        steps = [
            lm(mx.array([[a[j]] for a in after]), cache=batch, **kwargs(2))
            for j in range(2)
        ]
        ours = mx.stack([out.logits[:, -1] for out in steps], axis=1)
        worst = 0.0
        for i, prompt in enumerate(prompts):
            theirs = alone(prompt, drafts[i][: kept[i] + 1])
            worst = max(worst, mx.abs(ours[i] - theirs).max().item())
        return worst

    assert thread.run_sync(run) <= 1e-4


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


def edited(text: str) -> str:
    """``text`` with two characters changed a third of the way in."""
    cut = len(text) // 3
    return text[:cut] + "zq" + text[cut + 2 :]


def test_an_edited_prediction_alone_and_batched_answers_as_without(
    thread: MLXThread, family: LoadedModel
) -> None:
    """The prediction's drafts are kept up to the edit, refused there, and
    kept again after it: each refusal is rolled back."""
    off = thread.run_sync(BatchEngine, family, thread)
    reqs = [echo(0, 40), echo(1, 32), echo(2, 24)]
    alone = [interleaved(thread, off, [req])[0] for req in reqs]
    guessed = [
        echo(i, req[0].max_tokens, prediction=edited(text_of(events)))
        for i, (req, events) in enumerate(zip(reqs, alone, strict=True))
    ]
    on = thread.run_sync(BatchEngine, family, thread)
    solo = interleaved(thread, on, guessed[:1])
    assert max_logprob_difference(solo[0], alone[0]) <= TOL
    batched = interleaved(thread, on, guessed, (0, 2, 5))
    for mine, theirs in zip(batched, alone, strict=True):
        assert max_logprob_difference(mine, theirs) <= TOL
        final = mine[-1]
        assert isinstance(final, FinalEvent)
        assert final.accepted_prediction_tokens > 5
        assert final.rejected_prediction_tokens > 0


def test_prompt_lookup_drafts_on_them_and_answers_as_without(
    thread: MLXThread, family: LoadedModel
) -> None:
    def make() -> tuple[BatchEngine, BatchEngine]:
        on = BatchEngine(family, thread)
        on.speculate(LOOKUP)
        return BatchEngine(family, thread), on

    off, on = thread.run_sync(make)
    reqs = [echo(0, 32), echo(1, 24)]
    alone = [interleaved(thread, off, [req])[0] for req in reqs]
    for mine, theirs in zip(interleaved(thread, on, reqs, (0, 3)), alone, strict=True):
        assert max_logprob_difference(mine, theirs) <= TOL
    assert on.statistics().draft_tokens > 0
