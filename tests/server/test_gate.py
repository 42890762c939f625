"""The gate prices what each request will hold (its KV and media) under
``--max-kv-bytes``: the arithmetic, the budget's waits, refusals and loans
on their own, and a burst of long prompts on the real app, read off its
metrics and MLX's own counters."""

from __future__ import annotations

import random
import threading
from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import pytest
from PIL import Image

from mlx_pinned.server.events import GenerationParams
from mlx_pinned.server.failures import (
    MemoryBusyError,
    MemoryTooLargeError,
    OverloadedError,
)
from mlx_pinned.server.http.gate import (
    KV_STEP,
    TEMPLATE_TOKENS,
    BatchGate,
    Charge,
    MemoryBudget,
    Place,
    kv_tokens,
    price,
)

from .conftest import MODEL, assert_error
from .kit import WAIT, Serve

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def params(
    text: str = "hello", max_tokens: int = 16, **fields: Any
) -> GenerationParams:
    messages = ({"role": "user", "content": text},)
    return GenerationParams(messages=messages, max_tokens=max_tokens, **fields)


def budget_of(limit: int | None, **options: Any) -> MemoryBudget:
    return MemoryBudget(lambda: limit, **options)


def kv(tokens: int) -> Charge:
    """A request whose KV is ``tokens`` tokens of a byte each."""
    return Charge(tokens=tokens, per_token=1)


class TestPrice:
    def test_max_tokens_adds_its_tokens(self) -> None:
        short, long = price(params(), (), 512), price(params(max_tokens=116), (), 512)
        assert long.tokens - short.tokens == 100
        assert long.least - short.least == 100

    def test_the_prompt_is_bounded_by_its_bytes(self) -> None:
        text = "é" * 1000  # two bytes a character: at most a token a byte
        charge = price(params(text), (), 512)
        assert charge.tokens >= 2000 + TEMPLATE_TOKENS + 16
        assert charge.tokens < 2000 + TEMPLATE_TOKENS + 16 + 100  # the JSON

    def test_the_context_bounds_prompt_and_answer(self) -> None:
        charge = price(params("word " * 1000, 10**6, context_length=4096), (), 512)
        assert charge.tokens == charge.least == 4096
        assert charge.alone(charge.tokens) == 4096 * 512

    def test_images_add_their_pixels_and_take_the_prompt_limit(self) -> None:
        image = Image.new("RGB", (100, 50))
        asked = params(context_length=8192)
        alone, with_two = price(asked, (), 512), price(asked, (image, image), 512)
        assert alone.images == 0
        assert with_two.images == 2 * 5 * 100 * 50 * 3  # pixels, and as float32
        assert with_two.tokens == 8192  # image tokens are counted once processed

    def test_quantized_kv_costs_less(self) -> None:
        # The bytes a token takes (measured at load: test_kv_quant.py) scale
        # the KV, rounded up to the cache's growth step.
        floats, eight_bits = price(params(), (), 512), price(params(), (), 288)
        assert KV_STEP < floats.tokens == eight_bits.tokens < 2 * KV_STEP
        assert floats.alone(floats.tokens) == 2 * KV_STEP * 512
        assert eight_bits.alone(eight_bits.tokens) == 2 * KV_STEP * 288

    def test_token_ids_are_counted_and_the_kv_of_a_prompt_settled(self) -> None:
        ids = tuple(range(50))
        charge = price(params(prompt=ids, context_length=60), (), 1, len(ids))
        assert charge.least == charge.tokens == 60  # 50 + 16 cut by the context
        assert kv_tokens(params(max_tokens=16), 50) == 66


class TestMemoryBudget:
    async def test_a_request_that_never_fits_is_refused_at_entry(self) -> None:
        gate = BatchGate(4, 4, budget=budget_of(KV_STEP))
        with pytest.raises(MemoryTooLargeError, match="--max-kv-bytes"):
            async with gate.enter(0, Charge(0, 2 * KV_STEP, 1, 2 * KV_STEP)):
                pass
        assert (gate.active, gate.waiting) == (0, 0)

    async def test_one_that_settles_past_the_budget_is_refused(self) -> None:
        budget = budget_of(KV_STEP)
        gate = BatchGate(4, 4, budget=budget)
        async with gate.enter(0, kv(10)) as place:
            await place.turn()
            with pytest.raises(MemoryTooLargeError):
                place.settle(KV_STEP + 1)
        assert budget.charged == 0

    async def test_one_that_does_not_fit_now_waits_for_the_memory(self) -> None:
        budget = budget_of(2 * KV_STEP)
        gate = BatchGate(4, 4, budget=budget)
        async with gate.enter(0, kv(2 * KV_STEP)) as first:
            async with gate.enter(0, kv(KV_STEP)) as second:
                assert first.has_turn
                assert not second.has_turn
                assert budget.charged == 2 * KV_STEP
                first.settle(KV_STEP)  # its prompt was shorter than its bound
                assert second.has_turn
                assert budget.charged == 2 * KV_STEP
        assert budget.charged == 0

    async def test_a_full_waiting_room_refuses_while_memory_is_short(self) -> None:
        gate = BatchGate(4, 1, budget=budget_of(KV_STEP))
        async with gate.enter(0, kv(KV_STEP)), gate.enter(0, kv(KV_STEP)) as waits:
            assert not waits.has_turn
            with pytest.raises(OverloadedError) as refused:
                async with gate.enter(0, kv(1)):
                    pass
            assert refused.value.retry_after == 1

    async def test_media_that_does_not_fit_now_is_refused(self) -> None:
        gate = BatchGate(4, 4, budget=budget_of(KV_STEP))
        async with gate.enter(0, kv(KV_STEP)):
            with pytest.raises(MemoryBusyError):
                async with gate.enter(0, Charge(images=1)):
                    pass

    async def test_the_prompt_cache_lends_before_anyone_waits(self) -> None:
        lent: list[int] = []

        async def lend(nbytes: int) -> None:
            lent.append(nbytes)

        budget = budget_of(KV_STEP, lendable=lambda: KV_STEP, lend=lend)
        gate = BatchGate(4, 4, budget=budget)
        async with gate.enter(0, kv(KV_STEP)), gate.enter(0, kv(KV_STEP)) as second:
            await second.turn()  # once the cache made room
            assert lent == [KV_STEP]
            assert budget.charged == budget.capacity() == 2 * KV_STEP
        while budget.lent:  # the charges fell: the cache gets its bytes back
            await anyio.lowlevel.checkpoint()
        assert lent == [KV_STEP, 0]

    async def test_a_cache_that_cannot_lend_is_not_asked_again(self) -> None:
        asked: list[int] = []

        async def lend(nbytes: int) -> None:
            asked.append(nbytes)
            raise RuntimeError("the MLX thread is closed")

        budget = budget_of(KV_STEP, lendable=lambda: KV_STEP, lend=lend)
        gate = BatchGate(4, 4, budget=budget)
        async with gate.enter(0, kv(KV_STEP)), gate.enter(0, kv(KV_STEP)) as second:
            while not asked:
                await anyio.lowlevel.checkpoint()
            for _ in range(10):
                await anyio.lowlevel.checkpoint()
            assert asked == [KV_STEP]
            assert not second.has_turn  # it waits for the first, as unlent
            assert budget.lent == 0

    @pytest.mark.parametrize("seed", range(8))
    async def test_random_entries_and_ends_leave_nothing_charged(
        self, seed: int
    ) -> None:
        rng = random.Random(seed)
        budget = budget_of(6 * KV_STEP)
        gate = BatchGate(4, 6, budget=budget)
        over: list[int] = []

        async def one(bound: int, exact: int, hold: int, ending: str) -> None:
            with anyio.CancelScope() as scope:
                try:
                    async with gate.enter(rng.randint(0, 2), kv(bound)) as place:
                        if ending == "cancelled while waiting":
                            scope.cancel()
                        await place.turn()
                        if gate.active > 1 and budget.charged > budget.capacity():
                            over.append(budget.charged)
                        place.settle(exact)
                        for _ in range(hold):
                            await anyio.lowlevel.checkpoint()
                        if ending == "failed":
                            raise RuntimeError(ending)
                        if ending == "client gone":
                            scope.cancel()
                            await anyio.lowlevel.checkpoint()
                except (OverloadedError, MemoryTooLargeError, RuntimeError):
                    pass

        endings = ("done", "failed", "client gone", "cancelled while waiting")
        async with anyio.create_task_group() as group:
            for _ in range(60):
                bound = rng.randint(1, 8 * KV_STEP)
                exact = rng.randint(1, bound)
                ending = rng.choice(endings)
                group.start_soon(one, bound, exact, rng.randint(0, 5), ending)
                for _ in range(rng.randint(0, 3)):
                    await anyio.lowlevel.checkpoint()
        assert over == []
        assert (budget.charged, gate.active, gate.waiting) == (0, 0, 0)


def long_body(index: int, words: int = 300) -> dict[str, Any]:
    content = f"{index} " + "word " * words
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
    }


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


class TestBurst:
    async def test_a_request_that_can_never_fit_is_a_400_naming_the_setting(
        self, serve: Serve
    ) -> None:
        async with serve(max_kv_bytes=2**20, prompt_cache_bytes=0) as served:
            body = {**long_body(0, 10), "max_tokens": 30000}
            error = assert_error(
                await served.chat(body), 400, "messages", "context_length_exceeded"
            )
            assert "--max-kv-bytes" in error["message"]
            ok = await served.chat(long_body(1, 10))
            assert ok.status_code == 200, ok.text

    async def test_long_prompts_wait_or_get_a_503_and_stay_in_the_budget(
        self, serve: Serve
    ) -> None:
        budget_bytes = 4 * 2**20  # about four of these prompts' KV at once
        async with serve(
            max_kv_bytes=budget_bytes,
            max_num_seqs=32,
            max_pending=16,
            prompt_cache_bytes=0,
            # On the CPU backend attention is not fused: a prefill pass holds
            # heads x pass x prompt scores, which small passes keep small.
            prefill_step_size=32,
        ) as served:
            budget = served.app.state.memory
            gate = served.app.state.gate
            await served.chat(long_body(-1, 1))  # warm
            answers: list[Any] = []
            most_charged = most_active = 0
            arrived = anyio.Event()

            async def one(index: int) -> None:
                answers.append(await served.chat(long_body(index)))

            async def watch() -> None:
                nonlocal most_charged, most_active
                while len(answers) < 32:
                    most_charged = max(most_charged, budget.charged)
                    most_active = max(most_active, gate.active)
                    if gate.active + gate.waiting + len(answers) == 32:
                        arrived.set()
                    await anyio.lowlevel.checkpoint()

            # The MLX thread is held until every request entered the gate or
            # was refused, so that none ends before the last arrives.
            release = threading.Event()
            held = served.thread.submit(release.wait, WAIT)
            mx.reset_peak_memory()
            # The weights, and what earlier tests of this process left.
            before = mx.get_active_memory()
            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                for index in range(32):
                    group.start_soon(one, index)
                await arrived.wait()
                release.set()
            assert held.result()
            peak = mx.get_peak_memory()
            scraped = (await served.client.get("/metrics")).text

        statuses = sorted(answer.status_code for answer in answers)
        assert set(statuses) == {200, 503}, statuses
        refused = [answer for answer in answers if answer.status_code == 503]
        assert all(answer.headers["Retry-After"] == "1" for answer in refused)
        assert all(a.json()["error"]["code"] == "server_busy" for a in refused)
        admitted = statuses.count(200)
        assert 1 < most_active < admitted  # batched, and some waited their turn
        assert 0 < most_charged <= budget_bytes
        assert budget.charged == 0
        assert before >= served.engine.weight_bytes
        assert peak <= before + budget_bytes, (peak, before, most_charged)
        assert metric(scraped, "mlx_pinned_memory_budget_bytes") == budget_bytes
        assert metric(scraped, "mlx_pinned_memory_charged_bytes") == 0
        assert metric(scraped, "mlx_pinned_mlx_peak_bytes") >= peak


def test_a_place_out_of_every_gate_is_charged_nothing() -> None:
    assert Place(0, 0, Charge()).charge.alone(0) == 0
