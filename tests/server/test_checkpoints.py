"""The prompt cache for every kind of cache mlx-vlm builds
(``engine/checkpoints.py``): sliding-window and recurrent layers kept as
checkpoints beside plain KV. Turns 2-5 of a conversation with a long
system prompt and an image on turn 1 give the same tokens (log-probabilities
within 1e-4) with the cache on and off: alone, batched, chunked, and after a
restart from the disk tier; each turn takes nearly all of the previous
turn's prompt and answer from the cache.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.checkpoints import Prefix, State, kinds, restore, take
from mlx_pinned.server.engine.disk_format import model_fingerprint
from mlx_pinned.server.engine.prompt_cache import PromptCache
from mlx_pinned.server.engine.prompt_disk import DiskTier
from mlx_pinned.server.engine.sampling import vlm
from mlx_pinned.server.engine.state import BatchState
from mlx_pinned.server.events import FinalEvent, GenerationParams, SamplingParams
from mlx_pinned.testing import tiny_omni_path, tiny_vlm_path

from .kit import Event, all_at_once, image, max_logprob_difference

pytestmark = pytest.mark.anyio

TOL = 1e-4
BUDGET = 2**28
#: Sliding-window (gemma3), recurrent (qwen3_5) and plain KV (gemma4) layers.
FAMILIES = ("qwen3_5", "gemma3", "gemma4")
SENTENCE = (
    "You are a careful assistant for a visually impaired user. Describe what "
    "matters in the picture, in plain words. "
)
QUESTIONS = (
    "What is in this picture?",
    "What colours stand out?",
    "Is there any text or a sign?",
    "Summarise it in five words.",
    "Anything else?",
)


def path_of(model_type: str) -> Path:
    return (
        tiny_omni_path(model_type)
        if model_type == "gemma4"
        else tiny_vlm_path(model_type)
    )


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, thread: MLXThread) -> LoadedModel:
    model: LoadedModel = thread.run_sync(engine.load, path_of(request.param))
    return model


def params(messages: list[dict[str, Any]], max_tokens: int = 8) -> GenerationParams:
    greedy = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    return GenerationParams(tuple(messages), max_tokens=max_tokens, sampling=greedy)


def final(events: list[Event]) -> FinalEvent:
    last = events[-1]
    assert isinstance(last, FinalEvent)
    return last


async def run(
    engine: BatchEngine, messages: list[dict[str, Any]], images: list[Any]
) -> list[Event]:
    async with engine.stream(params(messages), images) as stream:
        return [event async for event in stream]


class Conversation:
    """A system prompt of ``repeats`` sentences, an image and a question on
    turn 1, then a question a turn; each turn's messages are the history
    with the cache-off answers."""

    def __init__(self, repeats: int, turns: int = 5) -> None:
        self.picture = image((64, 64), seed=3)
        self.turns: list[list[dict[str, Any]]] = []
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SENTENCE * repeats},
            {
                "role": "user",
                "content": [
                    {"type": "image_url"},
                    {"type": "text", "text": QUESTIONS[0]},
                ],
            },
        ]
        self.count = turns

    async def reference(self, off: BatchEngine) -> list[list[Event]]:
        """Each turn with the cache off, the history built from its answers."""
        answers = []
        for turn in range(self.count):
            if turn:
                self.messages.append({"role": "user", "content": QUESTIONS[turn]})
            self.turns.append(list(self.messages))
            events = await run(off, self.messages, [self.picture])
            answers.append(events)
            text = "".join(getattr(e, "text", "") for e in events)
            self.messages.append({"role": "assistant", "content": text})
        return answers


async def check_turns(
    on: BatchEngine,
    chat: Conversation,
    expected: list[list[Event]],
    turns: range,
    beside: bool = False,
    thread: MLXThread | None = None,
) -> None:
    """Turns ``turns`` on ``on`` equal ``expected``; from the second on each
    takes nearly all of the previous turn's prompt and answer from the cache
    (``beside``: each turn runs beside an unrelated request)."""
    for turn in turns:
        if beside:
            assert thread is not None
            other = params([{"role": "user", "content": f"Hello {turn}!"}])
            runs = await all_at_once(
                thread, on, [(params(chat.turns[turn]), [chat.picture]), (other, [])]
            )
            got = runs[0].events
        else:
            got = await run(on, chat.turns[turn], [chat.picture])
        assert max_logprob_difference(got, expected[turn]) <= TOL
        if turn:
            before = final(expected[turn - 1])
            previous = before.prompt_tokens + before.completion_tokens
            assert final(got).cached_tokens >= 0.95 * previous


async def conversation_on_and_off(
    thread: MLXThread, loaded: LoadedModel, repeats: int, tmp_path: Path
) -> None:
    chat = Conversation(repeats)
    expected = await chat.reference(BatchEngine(loaded, thread))
    assert final(expected[0]).prompt_tokens > repeats * 20
    turns = range(chat.count)
    await check_turns(
        BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET), chat, expected, turns
    )
    # Chunked: the prompt a chunk a step, checkpointed on the way.
    make = functools.partial(BatchState, checkpoint_tokens=192)
    chunked = BatchEngine(
        loaded,
        thread,
        prompt_cache_bytes=BUDGET,
        prefill_step_size=128,
        make_state=make,
    )
    await check_turns(chunked, chat, expected, turns)
    batched = BatchEngine(loaded, thread, prompt_cache_bytes=BUDGET)
    await check_turns(batched, chat, expected, turns, beside=True, thread=thread)
    # Turns 1-2, a restart, turns 3-5: turn 3 starts from the disk tier, and
    # the image cache's families take the image's features from there too.
    fingerprint = model_fingerprint(loaded.path)
    tower = loaded.model.vision_tower
    try:
        for part in (range(2), range(2, chat.count)):
            restarted = BatchEngine(
                loaded, thread, prompt_cache_bytes=BUDGET, image_cache_bytes=BUDGET
            )
            disk = DiskTier(tmp_path, BUDGET, fingerprint)
            await thread.run(restarted.attach, disk)
            await check_turns(restarted, chat, expected, part)
            disk.close()
            loaded.model.vision_tower = tower
        images = restarted.image_cache
        if loaded.config.model_type in ("qwen3_5", "gemma3"):
            assert images is not None
            assert (images.held.misses, images.held.disk_hits) == (0, 1)
    finally:
        loaded.model.vision_tower = tower


async def test_a_short_conversation_on_and_off(
    thread: MLXThread, family: LoadedModel, tmp_path: Path
) -> None:
    await conversation_on_and_off(thread, family, 6, tmp_path)


@pytest.mark.slow
async def test_a_conversation_with_a_long_system_prompt_on_and_off(
    thread: MLXThread, family: LoadedModel, tmp_path: Path
) -> None:
    """The issue's conversation: a ~2,000-token system prompt."""
    await conversation_on_and_off(thread, family, 30, tmp_path)


def ids_of(loaded: LoadedModel, messages: list[dict[str, Any]]) -> list[int]:
    from mlx_pinned.server.engine.model_inputs import preprocess

    prepared = preprocess(loaded, params(messages), [])
    return list(prepared.inputs["input_ids"][0].tolist())


async def test_a_prompt_resumes_at_the_last_checkpoint_it_shares(
    thread: MLXThread, family: LoadedModel, tmp_path: Path
) -> None:
    """A long prefill is checkpointed every 128 tokens: a prompt that shares
    its start resumes at the last checkpoint before they differ (a plain KV
    model at the token where they differ), from memory or from disk."""
    system = {"role": "system", "content": SENTENCE * 8}
    first = [system, {"role": "user", "content": "Tell me about the sea."}]
    second = [system, {"role": "user", "content": "Now the mountains, please."}]
    a = await thread.run(ids_of, family, first)
    b = await thread.run(ids_of, family, second)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    layers = await thread.run(
        lambda: kinds(vlm().make_prompt_cache(family.model.language_model))
    )
    assert layers is not None
    expected = common if all(layers) else common // 128 * 128
    reference = await run(BatchEngine(family, thread), second, [])
    make = functools.partial(BatchState, checkpoint_tokens=128)
    fingerprint = model_fingerprint(family.path)
    for restart in (False, True):
        on = BatchEngine(
            family,
            thread,
            prompt_cache_bytes=BUDGET,
            prefill_step_size=96,
            make_state=make,
        )
        disk = DiskTier(tmp_path / str(restart), BUDGET, fingerprint)
        await thread.run(on.attach, disk)
        await run(on, first, [])
        if restart:
            disk.close()
            on = BatchEngine(family, thread, prompt_cache_bytes=BUDGET)
            disk = DiskTier(tmp_path / str(restart), BUDGET, fingerprint)
            await thread.run(on.attach, disk)
        got = await run(on, second, [])
        disk.close()
        assert final(got).cached_tokens == expected
        assert max_logprob_difference(got, reference) <= TOL


class TestTheCacheWithStates:
    """``PromptCache`` holding a model's states: fake layers, a KV layer and
    a state layer, of a few tokens."""

    @staticmethod
    def layers(tokens: int, seed: int) -> list[Any]:
        kv = mx.full((1, 1, tokens, 2), float(seed))
        state = State({"state": [mx.full((1, 3), float(seed))], "meta_state": ""})
        return [(kv, kv + 1), state]

    def test_an_entry_resumes_only_at_its_checkpoints(self, thread: MLXThread) -> None:
        def go() -> list[int]:
            cache = PromptCache(BUDGET)
            cache.store(np.arange(1, 6), self.layers(5, 1))
            return [
                cache.lookup(np.arange(1, 9), 7).length,  # extends it: all five
                cache.lookup(np.array([1, 2, 3, 9]), 3).length,  # no checkpoint at 3
            ]

        assert thread.run_sync(go) == [5, 0]

    def test_a_longer_entry_takes_a_shorter_ones_checkpoints(
        self, thread: MLXThread
    ) -> None:
        """A checkpoint superseded by a longer one on its path goes first: its
        KV at once (the longer one holds it), its state kept with the other."""

        def go() -> tuple[int, int, int, float]:
            cache = PromptCache(BUDGET)
            cache.store(np.arange(1, 4), self.layers(3, 1))
            cache.store(np.arange(1, 8), self.layers(7, 2))
            stats = cache.statistics()
            prefix = cache.lookup(np.array([1, 2, 3, 9, 9]), 4)
            state = prefix.layers[1]
            assert isinstance(state, State)
            value = float(state.payload["state"][0][0, 0].item())
            return stats.entries, stats.bytes, prefix.length, value

        entries, nbytes, length, value = thread.run_sync(go)
        assert (entries, length, value) == (1, 3, 1.0)
        assert nbytes == 2 * (7 * 2 * 4) + 2 * (3 * 4)  # one KV, two states

    def test_take_and_restore_give_the_same_continuation(
        self, thread: MLXThread, family: LoadedModel
    ) -> None:
        def go() -> float:
            lm = family.model.language_model
            make = vlm().make_prompt_cache
            ids = mx.array([[(i * 7) % 300 + 20 for i in range(80)]])
            whole = make(lm)
            expected = lm(ids, cache=whole).logits[:, -1]
            first = make(lm)
            lm(ids[:, :50], cache=first)
            taken = take(first, None)
            assert taken is not None
            assert taken[0] == 50
            resumed = make(lm)
            restore(resumed, Prefix(50, taken[1]))
            got = lm(ids[:, 50:], cache=resumed).logits[:, -1]
            return float(mx.abs(got - expected).max().item())

        assert thread.run_sync(go) <= TOL
