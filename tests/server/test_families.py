"""Every tiny model family through the batch engine: batched equals solo.

Each family (the vision ones of ``TINY_MODEL_TYPES`` and the text-only ones
of ``TINY_LM_TYPES``) is loaded by the engine and run in batches whose rows
join and leave at different steps, with different prompts, prompt lengths
and image sizes; every row's per-token log-probabilities are compared with
the same request run alone through ``mlx_vlm.stream_generate``
(``reference.py``), within ``TOL`` (see ``test_batching.py`` for why 1e-5).
A family whose rows leak into each other (rope state kept on the model, a
prefill that mixes the images of a batch) moves them by 0.1 or more.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.events import Event
from mlx_pinned.server.failures import ImagesUnsupportedError
from mlx_pinned.server.http.served_models import BatchGate
from mlx_pinned.testing import (
    TINY_LM_TYPES,
    TINY_MODEL_TYPES,
    tiny_lm_path,
    tiny_vlm_path,
)

from .kit import PROMPTS as KIT_PROMPTS
from .kit import (
    TOL,
    Collector,
    Request,
    all_at_once,
    deadline,
    generate_inline,
    image,
    max_logprob_difference,
    solo,
    tokens,
)
from .kit import request as batching_request

pytestmark = pytest.mark.anyio

FAMILIES = [*TINY_MODEL_TYPES, *TINY_LM_TYPES]
PROMPTS = KIT_PROMPTS[:6]  # as many as the largest batch here has rows
# Image sizes per request (None: text only); a text model gets none.
SIZES: tuple[tuple[int, int] | None, ...] = (
    (64, 64),
    None,
    (32, 32),
    (96, 64),
    None,
    (128, 128),
)


@dataclass(frozen=True)
class Served:
    model_type: str
    loaded: LoadedModel

    @property
    def vision(self) -> bool:
        return self.model_type in TINY_MODEL_TYPES


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, thread: MLXThread) -> Served:
    model_type: str = request.param
    if model_type in TINY_MODEL_TYPES:
        path = tiny_vlm_path(model_type)
    else:
        path = tiny_lm_path(model_type)
    loaded: LoadedModel = thread.run_sync(engine.load, path)
    return Served(model_type, loaded)


async def queued(batch: BatchEngine, items: int) -> None:
    """Return once ``items`` requests wait for the batch's loop to admit them."""
    with anyio.fail_after(10):
        while batch.statistics().joining < items:  # noqa: ASYNC110 (no event to wait on)
            await anyio.sleep(0.001)


def request(family: Served, index: int, max_tokens: int, **params: Any) -> Request:
    """Request ``index``: its own prompt, and its own image size or none (a
    text model gets none)."""
    sizes = SIZES if family.vision else (None,)
    return batching_request(index, max_tokens, prompts=PROMPTS, sizes=sizes, **params)


class TestEveryFamily:
    @pytest.mark.slow
    async def test_rows_joining_and_leaving_match_each_solo_run(
        self, thread: MLXThread, family: Served
    ) -> None:
        # 0 leaves early; 4 and 5 join after it left, the others one by one.
        lengths = (5, 18, 14, 16, 10, 12)
        reqs = [request(family, i, n, top_logprobs=3) for i, n in enumerate(lengths)]
        alone = [await solo(thread, family.loaded, req) for req in reqs]
        batch = BatchEngine(family.loaded, thread)
        gate = BatchGate(max_num_seqs=6, max_pending=6)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        async with deadline() as group:
            for i in range(4):
                group.start_soon(runs[i].run)
                await runs[i].two_tokens.wait()
            await runs[0].done.wait()
            group.start_soon(runs[4].run)
            group.start_soon(runs[5].run)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        assert batch.statistics().peak_active >= 3

    @pytest.mark.slow
    async def test_prompts_arriving_together_match_each_solo_run(
        self, thread: MLXThread, family: Served
    ) -> None:
        reqs = [request(family, i, 6 + i, top_logprobs=2) for i in range(6)]
        alone = [await solo(thread, family.loaded, req) for req in reqs]
        batch = BatchEngine(family.loaded, thread)
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        assert batch.statistics().prefills == 6

    @pytest.mark.slow
    async def test_a_long_row_and_a_chunked_prompt_joining_it_match_solo(
        self, thread: MLXThread, family: Served
    ) -> None:
        # Row 0 decodes unpadded, alone at first, past a sliding window
        # (Gemma 3's layers slide over 16 tokens); row 1's prompt is longer
        # than the prefill step, so it is prefilled in chunks with mlx-vlm's
        # own caches and then joins row 0's batch cache.
        first = request(family, 0, 40, top_logprobs=2)
        chunked = batching_request(
            1, 10, prompts=(" ".join(PROMPTS),), sizes=(None,), top_logprobs=2
        )
        alone = [await solo(thread, family.loaded, req) for req in (first, chunked)]
        batch = BatchEngine(family.loaded, thread, prefill_step_size=48)
        gate = BatchGate(max_num_seqs=2, max_pending=0)
        runs = [Collector(thread, batch, gate, req) for req in (first, chunked)]
        async with deadline() as group:
            group.start_soon(runs[0].run)
            await runs[0].two_tokens.wait()
            group.start_soon(runs[1].run)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        stats = batch.statistics()
        assert (stats.peak_active, stats.prefills) == (2, 2)
        assert stats.prefill_passes >= 3  # row 0's, and two chunks or more

    @pytest.mark.slow
    async def test_a_text_prompt_then_an_image_prompt_together_match_solo(
        self, thread: MLXThread, family: Served
    ) -> None:
        # Prefilled in one pass, the image is not the first row's: an
        # embedding that places images by the first row's positions (Aya
        # Vision's in mlx-vlm) drops it.
        reqs = [request(family, i, 6, top_logprobs=2) for i in (1, 3)]
        alone = [await solo(thread, family.loaded, req) for req in reqs]
        batch = BatchEngine(family.loaded, thread)
        gate = BatchGate(max_num_seqs=2, max_pending=0)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        # The thread waits until both requests are queued, so both are
        # admitted before the step that prefills them.
        release = threading.Event()
        blocked = thread.submit(release.wait)
        async with deadline() as group:
            for run in runs:
                group.start_soon(run.run)
            await queued(batch, 2)
            release.set()
        assert blocked.result() is True
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        stats = batch.statistics()
        assert (stats.prefills, stats.peak_active) == (2, 2)

    @pytest.mark.slow
    async def test_seeded_sampling_matches_solo(
        self, thread: MLXThread, family: Served
    ) -> None:
        reqs = [
            request(family, i, 8, temperature=0.9, top_p=0.9, seed=100 + i)
            for i in range(3)
        ]
        alone = [await solo(thread, family.loaded, req) for req in reqs]
        batch = BatchEngine(family.loaded, thread)
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL

    def test_says_whether_it_takes_images(
        self, thread: MLXThread, family: Served
    ) -> None:
        batch = BatchEngine(family.loaded, thread)
        assert batch.facts.accepts_images is family.vision


@pytest.fixture(scope="module", params=TINY_LM_TYPES)
def text_family(request: pytest.FixtureRequest, thread: MLXThread) -> Served:
    loaded: LoadedModel = thread.run_sync(engine.load, tiny_lm_path(request.param))
    return Served(request.param, loaded)


class TestTextModels:
    def test_an_image_is_refused_before_anything_runs(
        self, thread: MLXThread, text_family: Served
    ) -> None:
        params, _ = request(text_family, 0, 4)
        batch = BatchEngine(text_family.loaded, thread)
        events = generate_inline(batch, params, [image((64, 64), 0)])
        with pytest.raises(ImagesUnsupportedError) as caught:
            thread.run_sync(next, events)
        assert caught.value.code == "images_unsupported"
        assert batch.statistics().prefills == 0


class TestOneAtATime:
    @pytest.mark.slow
    async def test_rows_run_one_after_another_each_as_alone(
        self, thread: MLXThread, family: Served
    ) -> None:
        # What a family the batch is not proven exact on gets: arriving
        # together, the rows still run one at a time, each prefilled alone.
        reqs = [request(family, i, 4 + i, top_logprobs=2) for i in range(4)]
        alone = [await solo(thread, family.loaded, req) for req in reqs]
        batch = BatchEngine(family.loaded, thread)
        batch._state.exclusive = True
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        stats = batch.statistics()
        assert (stats.peak_active, stats.prefills, stats.prefill_passes) == (1, 4, 4)

    def test_an_unproven_family_is_served_one_at_a_time(
        self,
        thread: MLXThread,
        family: Served,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        assert not BatchEngine(family.loaded, thread)._state.exclusive
        monkeypatch.setattr(engine.model, "EXACT_FAMILIES", frozenset())
        assert BatchEngine(family.loaded, thread)._state.exclusive
        assert f"not proven exact on the {family.model_type} family" in caplog.text


@pytest.fixture(scope="module")
def ministral3(
    thread: MLXThread, tmp_path_factory: pytest.TempPathFactory
) -> LoadedModel:
    """The tiny Mistral 3 with a Ministral 3 decoder (as Ministral 3's
    checkpoints have): its attention scale grows past 8 positions."""
    path = tmp_path_factory.mktemp("ministral3") / "model"
    shutil.copytree(tiny_vlm_path("mistral3"), path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["model_type"] = "ministral3"
    config["text_config"]["rope_parameters"] = {
        "type": "default",
        "rope_theta": 1000000000.0,
        "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 8,
    }
    (path / "config.json").write_text(json.dumps(config))
    loaded: LoadedModel = thread.run_sync(engine.load, path)
    return loaded


def moved(batched: list[Event], alone: list[Event]) -> float:
    """How far the chosen tokens' log-probabilities moved (inf: other
    tokens, or NaN)."""
    ours, theirs = tokens(batched), tokens(alone)
    pairs = [(a.logprobs, b.logprobs) for a, b in zip(ours, theirs, strict=True)]
    if any(a is None or b is None or a.token != b.token for a, b in pairs):
        return float("inf")
    gaps = [abs(a.logprob - b.logprob) for a, b in pairs if a and b]
    return max(gaps, default=0.0) if not any(map(math.isnan, gaps)) else float("inf")


class TestAVariantThatCannotBeBatched:
    """Mistral 3 batches exactly, but not with a Ministral 3 decoder: mlx-vlm's
    scales every row's queries by the first row's position."""

    async def test_batched_its_rows_change_each_other(
        self, thread: MLXThread, ministral3: LoadedModel
    ) -> None:
        # Why it is served one at a time: batched anyway, rows of different
        # lengths move away from their solo runs.
        reqs = [
            batching_request(i, 6, prompts=PROMPTS, sizes=(None,)) for i in range(3)
        ]
        alone = [await solo(thread, ministral3, req) for req in reqs]
        batch = BatchEngine(ministral3, thread)
        batch._state.exclusive = False
        runs = await all_at_once(thread, batch, reqs)
        pairs = zip(runs, alone, strict=True)
        assert max(moved(run.events, expected) for run, expected in pairs) > 1e-2

    async def test_it_is_served_one_at_a_time_each_as_alone(
        self,
        thread: MLXThread,
        ministral3: LoadedModel,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        reqs = [
            batching_request(i, 6, prompts=PROMPTS, sizes=SIZES[:3], top_logprobs=2)
            for i in range(3)
        ]
        alone = [await solo(thread, ministral3, req) for req in reqs]
        batch = BatchEngine(ministral3, thread)
        assert batch._state.exclusive
        assert "Ministral 3 decoder" in caplog.text
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        assert batch.statistics().peak_active == 1
