"""The prompt cache: keys that tell images apart, LRU within a budget, and
answers that are the same with the cache on and off (logprobs within 1e-4).

Cache on or off changes only how the prompt's KV is computed: from a cached
prefix plus the rest, or all at once; the tolerance allows the float32
rounding of attention computed in other shapes.
"""

from __future__ import annotations

import io
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.model_inputs import preprocess
from mlx_pinned.server.engine.prompt_cache import PromptCache, prompt_key
from mlx_pinned.server.events import FinalEvent, GenerationParams, SamplingParams
from mlx_pinned.testing import make_test_image

from .kit import Event, all_at_once, deadline, max_logprob_difference

pytestmark = pytest.mark.anyio

TOL = 1e-4
IMAGE_TOKEN = 6  # <|image_pad|> of the tiny model
BUDGET = 64 * 1024 * 1024


def picture(size: int, seed: int) -> Image.Image:
    data = make_test_image(size, size, seed=seed)
    return Image.open(io.BytesIO(data)).convert("RGB")


def user(text: str, image: bool = False) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image:
        parts.insert(0, {"type": "image_url"})
    return {"role": "user", "content": parts}


def params(messages: list[dict[str, Any]], max_tokens: int = 8) -> GenerationParams:
    return GenerationParams(
        tuple(messages),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
    )


async def run(
    engine: BatchEngine, p: GenerationParams, images: list[Any]
) -> list[Event]:
    async with engine.stream(p, images) as stream:
        return [event async for event in stream]


def final(events: list[Event]) -> FinalEvent:
    last = events[-1]
    assert isinstance(last, FinalEvent)
    return last


def answer(events: list[Event]) -> str:
    return "".join(e.text for e in events)


class TestKeys:
    def test_images_become_their_hashes(self) -> None:
        ids = [1, 2, 9, 9, 9, 3, 9, 9, 4]
        key = prompt_key(ids, [11, 22], frozenset({9}))
        assert key is not None
        assert key.tolist() == [1, 2, -12, -12, -12, 3, -23, -23, 4]
        other = prompt_key(ids, [11, 33], frozenset({9}))
        assert other is not None
        assert other.tolist()[:6] == key.tolist()[:6]
        assert other.tolist()[6] != key.tolist()[6]

    def test_runs_that_do_not_match_the_images_are_not_cached(self) -> None:
        assert prompt_key([1, 9, 9, 2], [], frozenset({9})) is None
        assert prompt_key([1, 9, 9, 2], [5, 6], frozenset({9})) is None


class TestPromptCacheUnit:
    def layers(self, tokens: int) -> list[tuple[mx.array, mx.array]]:
        array = mx.arange(tokens * 4, dtype=mx.float32).reshape(1, 1, tokens, 4)
        return [(array, array + 1)]

    def test_longest_prefix_and_limit(self, thread: MLXThread) -> None:
        def go() -> tuple[int, int, int, int]:
            cache = PromptCache(BUDGET)
            cache.store(np.array([1, 2, 3, 4, 5]), self.layers(5))
            a = cache.lookup(np.array([1, 2, 3, 7]), 10).length
            b = cache.lookup(np.array([1, 2, 3, 4, 5, 6]), 4).length
            prefix = cache.lookup(np.array([9]), 10)
            return a, b, prefix.length, len(prefix.layers)

        assert thread.run_sync(go) == (3, 4, 0, 0)

    def test_an_entry_that_is_a_prefix_of_a_new_one_goes(
        self, thread: MLXThread
    ) -> None:
        def go() -> tuple[int, int]:
            cache = PromptCache(BUDGET)
            cache.store(np.array([1, 2, 3]), self.layers(3))
            cache.store(np.array([1, 2, 3, 4]), self.layers(4))
            stats = cache.statistics()
            return stats.entries, stats.bytes

        assert thread.run_sync(go) == (1, 2 * 4 * 4 * 4)

    def test_least_recently_used_leaves_first_within_the_budget(
        self, thread: MLXThread
    ) -> None:
        def go() -> tuple[int, int, int]:
            cache = PromptCache(3 * 2 * 4 * 4 * 4)  # three 4-token entries
            for first in (1, 2, 3):
                cache.store(np.array([first, 0, 0, 0]), self.layers(4))
            cache.lookup(np.array([1, 0]), 2)  # 1 is used: 2 is the oldest
            cache.store(np.array([4, 0, 0, 0]), self.layers(4))
            one = cache.lookup(np.array([1, 0]), 2).length
            two = cache.lookup(np.array([2, 0]), 2).length
            return one, two, cache.statistics().entries

        assert thread.run_sync(go) == (2, 0, 3)

    def test_what_it_lends_is_dropped_now_and_kept_free(
        self, thread: MLXThread
    ) -> None:
        entry = 2 * 4 * 4 * 4  # one 4-token entry

        def go() -> tuple[int, int, int, int]:
            cache = PromptCache(3 * entry)
            for first in (1, 2, 3):
                cache.store(np.array([first, 0, 0, 0]), self.layers(4))
            cache.lend(2 * entry)  # the two oldest go now
            held = cache.statistics().bytes
            oldest = cache.lookup(np.array([1, 0]), 2).length
            cache.store(np.array([4, 0, 0, 0]), self.layers(4))  # 3 goes
            newest = cache.lookup(np.array([4, 0]), 2).length
            cache.lend(0)  # all of its budget back
            cache.store(np.array([5, 0, 0, 0]), self.layers(4))
            return held, oldest, newest, cache.statistics().entries

        assert thread.run_sync(go) == (entry, 0, 2, 2)


class TestSameAnswersWithTheCache:
    @pytest.mark.slow
    async def test_turns_of_an_image_conversation(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        on = BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET)
        off = BatchEngine(loaded, thread)
        image = picture(64, 1)
        messages = [user("Describe this image.", image=True)]
        questions = ["And the colours?", "How many shapes?", "Anything else?"]
        for turn in range(4):
            cached = await run(on, params(messages), [image])
            fresh = await run(off, params(messages), [image])
            assert max_logprob_difference(cached, fresh) <= TOL
            if turn:
                # Everything up to this turn's question was cached.
                assert final(cached).cached_tokens > final(cached).prompt_tokens // 2
            if turn < 3:
                messages.append({"role": "assistant", "content": answer(fresh)})
                messages.append(user(questions[turn]))
        assert on.prompt_cache.statistics().hits >= 3

    async def test_same_image_new_question_hits_different_image_does_not(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        on = BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET)
        off = BatchEngine(loaded, thread)
        first, second = picture(64, 1), picture(64, 2)  # same size, same tokens
        ask = [user("What is in this picture?", image=True)]
        await run(on, params(ask), [first])
        again = [user("What colour is it?", image=True)]
        hit = await run(on, params(again), [first])
        assert (
            max_logprob_difference(hit, await run(off, params(again), [first])) <= TOL
        )
        assert final(hit).cached_tokens > 4  # through the image
        other = await run(on, params(ask), [second])
        expected = await run(off, params(ask), [second])
        assert max_logprob_difference(other, expected) <= TOL
        prepared = await thread.run(preprocess, loaded, params(ask), [second])
        ids = prepared.inputs["input_ids"][0].tolist()
        # Only the text before the image could be shared.
        assert 0 < final(other).cached_tokens <= ids.index(IMAGE_TOKEN)

    @pytest.mark.slow
    async def test_concurrent_requests_sharing_a_prefix(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        on = BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET)
        off = BatchEngine(loaded, thread)
        image = picture(96, 3)
        system = {"role": "system", "content": "You describe images. " * 8}
        await run(on, params([system, user("Warm up.")]), [])
        reqs = [
            (
                params([system, user(f"Question {i}?", image=i % 2 == 0)], 10),
                [image] if i % 2 == 0 else [],
            )
            for i in range(6)
        ]
        expected = [await run(off, *req) for req in reqs]
        runs = await all_at_once(thread, on, reqs)
        for each, theirs in zip(runs, expected, strict=True):
            assert max_logprob_difference(each.events, theirs) <= TOL
            assert final(each.events).cached_tokens > 0

    async def test_a_cached_prefix_then_a_chunked_prefill(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        on = BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET, prefill_step_size=8)
        off = BatchEngine(loaded, thread)
        image = picture(64, 4)
        start = [user("Tell me about this image.", image=True)]
        first = await run(on, params(start), [image])
        longer = [
            *start,
            {"role": "assistant", "content": answer(first)},
            user("Now a much longer question, " * 6),
        ]
        cached = await run(on, params(longer), [image])
        assert final(cached).cached_tokens > 0
        assert (
            max_logprob_difference(cached, await run(off, params(longer), [image]))
            <= TOL
        )


class TestChunkedPrefill:
    async def test_prompts_from_the_cache_join_the_batch_together(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        """Prompts whose start the cache holds are a few tokens each from
        their end: they share one step's chunk, not one step each, so eight
        of them decode side by side, each as it would alone."""
        on = BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET)
        off = BatchEngine(loaded, thread)
        system = {"role": "system", "content": "You answer in one line. " * 8}
        await run(on, params([system, user("Warm up.")]), [])
        reqs = [(params([system, user(f"Question {i}?")], 12), []) for i in range(8)]
        expected = [await run(off, *req) for req in reqs]
        steps = on.counters().decode_steps
        runs = await all_at_once(thread, on, reqs)
        # 12 tokens: 11 steps after the first, and one more per late arrival.
        assert on.counters().decode_steps - steps <= 13
        for each, theirs in zip(runs, expected, strict=True):
            assert final(each.events).cached_tokens > 0
            assert max_logprob_difference(each.events, theirs) <= TOL

    async def test_running_streams_get_tokens_between_a_long_prompts_chunks(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        engine = BatchEngine(loaded, thread, prefill_step_size=16)
        whole = BatchEngine(loaded, thread)  # one chunk: the whole prompt
        long_prompt = [user("Read this carefully: " + "the quick brown fox " * 30)]
        expected = await run(whole, params(long_prompt, 6), [])
        order: list[str] = []
        running_started = anyio.Event()

        async def running() -> None:
            p = params([user("Count to ten.")], 60)
            async with engine.stream(p, []) as stream:
                async for _ in stream:
                    order.append("running")
                    running_started.set()

        async def arriving() -> list[Event]:
            await running_started.wait()
            order.append("arrives")
            async with engine.stream(params(long_prompt, 6), []) as stream:
                events = []
                async for event in stream:
                    order.append("long")
                    events.append(event)
                return events

        results: list[list[Event]] = []

        async def keep(events: Any) -> None:
            results.append(await events)

        async with deadline() as group:
            group.start_soon(running)
            group.start_soon(keep, arriving())
        prompt_tokens = final(results[0]).prompt_tokens
        assert prompt_tokens > 8 * 16  # many chunks
        between = order[order.index("arrives") : order.index("long")]
        # The running stream was not held for the whole prefill.
        assert between.count("running") >= prompt_tokens // 16 // 2
        assert max_logprob_difference(results[0], expected) <= TOL


class TestImageCache:
    async def test_images_sent_again_are_not_encoded_again(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        cached = BatchEngine(loaded, thread, image_cache_bytes=BUDGET)
        assert cached.image_cache is not None
        try:
            one, two = picture(64, 5), picture(64, 6)  # same size: same tokens
            both = [
                user("Compare these.", image=True),
                user("And this one?", image=True),
            ]
            first = await run(cached, params([user("What is it?", image=True)]), [one])
            # One image known, one new; then both known; then together with
            # other prompts (prefilled in one pass).
            mixed = await run(cached, params(both), [one, two])
            again = await run(cached, params(both), [one, two])
            reqs = [
                (params(both), [one, two]),
                (params([user("Hi?", image=True)]), [two]),
            ]
            runs = await all_at_once(thread, cached, reqs)
            held = cached.image_cache.held
            assert (held.misses, held.hits) == (2, 1 + 2 + 3)
        finally:
            # The same model serves the other tests: give its tower back.
            loaded.model.vision_tower = cached.image_cache.tower
        plain = BatchEngine(loaded, thread)
        assert (
            max_logprob_difference(
                first,
                await run(plain, params([user("What is it?", image=True)]), [one]),
            )
            <= TOL
        )
        expected = await run(plain, params(both), [one, two])
        for events in (mixed, again, runs[0].events):
            assert max_logprob_difference(events, expected) <= TOL
        lone = await run(plain, *reqs[1])
        assert max_logprob_difference(runs[1].events, lone) <= TOL
