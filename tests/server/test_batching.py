"""Continuous batching: isolation, joins and leaves, disconnects, seeds, bounds.

Every test drives the real tiny Qwen3-VL on a real MLX thread. Batched runs
are compared with mlx-vlm's own loop (``mlx_vlm.stream_generate``, one
request alone on the model: ``reference.py``) by their per-token
log-probabilities: random weights give degenerate text that hides
cross-talk between sequences, log-probabilities
do not (a leak of rope state moved them by up to 0.48 here).

Tolerance: ``TOL`` = 1e-5, absolute, on float32 log-probabilities (values of
order 1-10). Batching changes only the shapes a sequence is computed in:
prompts prefilled together are left-padded, the decode cache is left-padded,
and padded positions are masked, so they add exact zeros; matmul rows are
independent. What may legitimately differ on another backend is the order of
float32 reductions over a longer, masked axis, i.e. rounding of a few ulps
(~1e-6). Measured here, on the CPU backend: 0.0, bit-identical. Cross-talk is
four to five orders of magnitude larger (a leaked rope delta: 0.1 to 1).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest

from mlx_pinned import MLXThread, MLXThreadClosedError
from mlx_pinned.server import engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine import decode as _decode
from mlx_pinned.server.engine.sampling import Sampled, collect, draw
from mlx_pinned.server.events import FinalEvent, SamplingParams, TokenEvent
from mlx_pinned.server.failures import OverloadedError, PromptTooLongError
from mlx_pinned.server.http.served_models import BatchGate
from mlx_pinned.testing import tiny_vlm_path

from .conftest import until
from .kit import (
    PROMPTS,
    TOL,
    Collector,
    Event,
    Request,
    all_at_once,
    deadline,
    drain,
    generate_inline,
    image,
    max_logprob_difference,
    request,
    solo,
    tokens,
)

pytestmark = pytest.mark.anyio


class TestIsolation:
    @pytest.mark.slow
    async def test_batch_of_8_matches_each_solo_run(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # Different prompts, image sizes and lengths; 0 leaves early, 6 and 7
        # join after it left, the others join one by one mid-batch. Row 1
        # outlasts the turns the loop may run ahead of a busy event loop.
        lengths = (6, 80, 24, 20, 16, 28, 12, 18)
        reqs = [request(i, n, top_logprobs=3) for i, n in enumerate(lengths)]
        alone = [await solo(thread, loaded, req) for req in reqs]

        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=8, max_pending=8)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        async with deadline() as group:
            for i in range(6):
                group.start_soon(runs[i].run)
                await runs[i].two_tokens.wait()
            await runs[0].done.wait()
            assert not runs[1].done.is_set()
            group.start_soon(runs[6].run)
            group.start_soon(runs[7].run)

        worst = max(
            max_logprob_difference(run.events, expected)
            for run, expected in zip(runs, alone, strict=True)
        )
        assert worst <= TOL
        stats = batch.statistics()
        assert stats.prefills == 8
        assert stats.peak_active >= 6
        assert (stats.active, stats.joining) == (0, 0)
        assert thread.statistics().open_streams == 0

    # The families with rope deltas whose text prompts are prefilled together.
    @pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
    async def test_text_prompts_of_different_lengths_prefilled_together(
        self, thread: MLXThread, family: str
    ) -> None:
        # Without images in the pass, mlx-vlm's rope deltas count each row's
        # left padding, which the batch cache's offsets leave out: a padded
        # row's decode positions moved by its padding from its second token.
        loaded = await thread.run(engine.load, tiny_vlm_path(model_type=family))
        texts = ["Hi", PROMPTS[0], " ".join(PROMPTS[:3])]
        reqs = [request(0, 12, prompts=[t], sizes=[None]) for t in texts]
        alone = [await solo(thread, loaded, req) for req in reqs]
        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=3, max_pending=0)
        runs = [Collector(thread, batch, gate, req) for req in reqs]

        def hold() -> None:  # until all three are queued: one prefill pass
            deadline = time.monotonic() + 30
            while batch.statistics().joining < 3 and time.monotonic() < deadline:
                time.sleep(0.002)

        held = thread.submit(hold)
        async with deadline() as group:
            for run in runs:
                group.start_soon(run.run)
        held.result()
        assert batch.statistics().prefill_passes == 1
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL

    def test_steps_skip_the_attention_mask_only_while_no_row_is_padded(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # The numbers are the same either way (the other tests here compare
        # every batch, padded or not, with its unbatched runs).
        def check() -> list[bool]:
            batch = BatchEngine(loaded, thread)
            state = batch._state
            seen = []

            def unmasked() -> bool:
                assert state.cache is not None
                first_layer = state.cache[0]
                skipped = "make_mask" in vars(first_layer)
                assert (first_layer.make_mask(1) is None) == skipped
                assert first_layer.make_mask(3) is not None  # prefill keeps it
                return skipped

            first = generate_inline(batch, *request(0, 40, logprobs=False))
            next(first)
            next(first)
            seen.append(unmasked())  # one row, no padding
            second = generate_inline(batch, *request(1, 40, logprobs=False))
            next(second)  # joined, left-padded to the first's length
            seen.append(unmasked())
            second.close()  # leaves; a later step drops it, and the padding
            for _ in range(4):  # tokens already sampled, then new steps
                next(first)
            seen.append(unmasked())
            first.close()
            return seen

        assert thread.run_sync(check) == [True, False, True]

    def test_each_step_is_built_before_the_previous_is_read(
        self, thread: MLXThread, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # L: a decode step is built and started; C: a step's tokens are read.
        # The first token comes from the prefill; no step is built past a
        # row's max_tokens-th token.
        log: list[str] = []
        read = _decode.collect

        def collect(*args: Any) -> Any:
            log.append("C")
            return read(*args)

        monkeypatch.setattr(_decode, "collect", collect)

        def run() -> list[Event]:
            batch = BatchEngine(loaded, thread)
            state = batch._state
            lm = state.lm

            def forward(*args: Any, **kwargs: Any) -> Any:
                log.append("L")
                return lm(*args, **kwargs)

            state.lm = forward
            return list(generate_inline(batch, *request(0, 5, logprobs=False)))

        events = thread.run_sync(run)
        assert sum(isinstance(e, TokenEvent) for e in events) == 5
        assert "".join(log) == "CLLCLCLCC"

    def test_a_step_built_ahead_adds_nothing_after_an_end_of_turn(
        self, thread: MLXThread, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Row 0's second decoded token is its end of turn; the step after it
        # was built before that was known, with row 0 in it: its token there
        # is dropped, and the row leaves the batch.
        def run() -> tuple[list[bool], int, int, int]:
            state = BatchEngine(loaded, thread)._state
            a = state.admit(*request(0, 10, logprobs=False))
            b = state.admit(*request(1, 10, logprobs=False))
            calls = 0
            ends = SamplingParams.ends

            def end_of_turn(sampling: SamplingParams, token: int) -> bool:
                nonlocal calls
                calls += 1  # rows in order: first tokens, then each step
                return calls == 5 or ends(sampling, token)

            monkeypatch.setattr(SamplingParams, "ends", end_of_turn)
            for _ in range(4):
                state.step()
            ended = [item.eos for item in a.pending]
            return ended, len(b.pending), state.statistics().decoded_tokens, calls

        ended, b_tokens, decoded, calls = thread.run_sync(run)
        assert calls == 2 + 2 + 2 + 2  # row 0 was in the step built ahead
        assert ended == [False, False, True]  # first token, step 1, end of turn
        assert b_tokens == 4
        assert decoded == 2 + 3

    def test_a_failed_read_fails_the_row_whose_last_token_it_held(
        self, thread: MLXThread, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Row 0's second token is its last: the step built ahead leaves it
        # out, so it is no longer in the batch when the step holding that
        # token is read. A failure there must still reach it.
        read = _decode.collect
        calls = 0

        def collect(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # the first decode step (1: the prefill's)
                raise RuntimeError("injected")
            return read(*args)

        monkeypatch.setattr(_decode, "collect", collect)

        def run() -> list[tuple[bool, str]]:
            state = BatchEngine(loaded, thread)._state
            rows = [
                state.admit(*request(0, 2, logprobs=False)),
                state.admit(*request(1, 10, logprobs=False)),
            ]
            state.step()  # prefill: first tokens
            state.step()  # its failure ends the rows it touched, and returns
            return [(row.done, repr(row.error and row.error.__cause__)) for row in rows]

        failed = (True, repr(RuntimeError("injected")))
        assert thread.run_sync(run) == [failed, failed]

    async def test_prompts_arriving_together_are_prefilled_together(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # Different lengths and image sizes, one without an image: padded and
        # masked into one pass, each still matches its unbatched run.
        reqs = [request(i, 5 + i, top_logprobs=2) for i in range(8)]
        alone = [await solo(thread, loaded, req) for req in reqs]
        batch = BatchEngine(loaded, thread)
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        stats = batch.statistics()
        assert stats.prefills == 8
        assert stats.prefill_passes < 8

    async def test_stops_bias_and_end_of_turn_match_solo(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
        full = await solo(thread, loaded, request(1, 20, logprobs=False))
        text = "".join(e.text for e in full)
        stop = text[6:9]
        reqs = [
            request(1, 20, logprobs=False, stop=("zzz", stop)),
            request(2, 12, logit_bias=((im_end, 100.0),)),  # ends at once
            request(3, 9, logit_bias=((5, -100.0), (7, 2.5))),
            request(4, 14, top_logprobs=5),
        ]
        alone = [await solo(thread, loaded, req) for req in reqs]
        finals = [events[-1] for events in alone]
        assert [
            f.finish_reason if isinstance(f, FinalEvent) else None for f in finals
        ] == [
            "stop",
            "stop",
            "length",
            "length",
        ]
        assert len(alone[1]) == 1  # the end of turn came first: no token

        batch = BatchEngine(loaded, thread)
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert run.events == expected or (
                max_logprob_difference(run.events, expected) <= TOL
            )

    async def test_a_failing_request_leaves_the_batch_alone(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        good = request(0, 16)
        alone = await solo(thread, loaded, good)
        # An image with no image marker in the prompt: the model refuses it.
        params, _ = request(4, 8)
        bad: Request = (params, [image((64, 64), seed=1)])

        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=2, max_pending=0)
        run = Collector(thread, batch, gate, good)
        async with deadline() as group:
            group.start_soon(run.run)
            await run.two_tokens.wait()
            with pytest.raises(Exception):  # noqa: B017, PT011 - mlx-vlm's own error
                await drain(batch.stream(*bad))
        assert max_logprob_difference(run.events, alone) <= TOL
        assert batch.statistics().prefills == 1

    async def test_a_prompt_over_its_limit_is_refused_before_prefill(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        params, images = request(0, 4)
        limited = dataclasses.replace(params, max_prompt_tokens=5)
        batch = BatchEngine(loaded, thread)
        with pytest.raises(PromptTooLongError) as caught:
            await drain(batch.stream(limited, images))
        assert caught.value.limit == 5
        assert batch.statistics().prefills == 0


class TestLeaving:
    async def test_disconnect_mid_batch_frees_its_slot(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # Long enough that neither a (parked) nor b ends before c is admitted.
        reqs = [request(0, 400), request(1, 120), request(2, 30)]
        alone_b = await solo(thread, loaded, reqs[1])
        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=2, max_pending=4)
        a, b, c = (Collector(thread, batch, gate, req) for req in reqs)
        leave = anyio.Event()
        async with deadline() as group:
            group.start_soon(a.run, leave)  # a client that stops reading, then leaves
            await a.started.wait()
            group.start_soon(b.run)
            await b.two_tokens.wait()
            group.start_soon(c.run)
            await until(lambda: gate.waiting == 1)
            assert not c.started.is_set()  # two active: c waits its turn
            assert batch.statistics().active == 2
            leave.set()
            await a.done.wait()
            # a's stream was closed on the thread before its slot came back.
            await c.two_tokens.wait()
            assert gate.active == 2
            assert batch.statistics().active + batch.statistics().joining <= 2
            assert thread.statistics().open_streams <= 2
        assert len(a.events) == 3
        assert max_logprob_difference(b.events, alone_b) <= TOL
        alone_c = await solo(thread, loaded, reqs[2])
        assert max_logprob_difference(c.events, alone_c) <= TOL
        assert batch.statistics().peak_active == 2
        assert thread.statistics().open_streams == 0

    async def test_max_num_seqs_is_respected(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        reqs = [request(i, 6 + i) for i in range(10)]
        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=3, max_pending=10)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        async with deadline() as group:
            for run in runs:
                group.start_soon(run.run)
        peak = max(run.active_at_start for run in runs)
        assert peak == 3
        assert batch.statistics().peak_active == 3
        for i, run in enumerate(runs):
            assert len(tokens(run.events)) == 6 + i


def rows(batch: BatchEngine) -> int:
    stats = batch.statistics()
    return stats.active + stats.joining


class TestLoop:
    async def test_every_request_of_a_model_shares_its_one_loop(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # The batch is stepped by the model's loop, one stream on the thread
        # however many requests read it; it closes once its readers left.
        reqs = [request(i, 400, logprobs=False) for i in range(4)]
        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=4, max_pending=0)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        leave = anyio.Event()
        before = thread.statistics()
        async with deadline() as group:
            for run in runs:
                group.start_soon(run.run, leave)
            for run in runs:
                await run.two_tokens.wait()
            during = thread.statistics()
            stats = batch.statistics()
            leave.set()
        await thread.run(lambda: None)
        after = thread.statistics()
        assert during.open_streams == before.open_streams + 1
        assert stats.active == 4
        assert all(len(run.events) == 3 for run in runs)
        assert after.open_streams == before.open_streams
        assert (batch.statistics().active, batch.statistics().joining) == (0, 0)

    async def test_a_dropped_stream_takes_its_row_out(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        batch = BatchEngine(loaded, thread)
        stream = batch.stream(*request(0, 4000, logprobs=False))
        await stream.__anext__()
        assert rows(batch) == 1
        del stream
        gc.collect()
        with anyio.fail_after(20):
            while rows(batch):  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.001)
            while thread.statistics().open_streams:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        # Taken out, not decoded to its max_tokens.
        assert batch.statistics().decoded_tokens < 4000 - 1

    async def test_a_thread_closed_under_the_loop_fails_its_requests(
        self, tiny_model_path: Path
    ) -> None:
        with MLXThread(name="test-loop-closed") as own:
            loaded = await own.run(engine.load, tiny_model_path)
            batch = BatchEngine(loaded, own)
            streams = [batch.stream(*request(i, 400, logprobs=False)) for i in (0, 1)]
            for stream in streams:
                await stream.__anext__()
            own.shutdown(wait=False, cancel_futures=True)
            with anyio.fail_after(10):
                for stream in streams:
                    with pytest.raises(MLXThreadClosedError):
                        async for _ in stream:
                            pass
                    await stream.aclose()
            with pytest.raises(MLXThreadClosedError):
                batch.stream(*request(2, 4))

    def test_a_generation_inline_runs_the_loop_on_its_own_thread(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # generate_inline steps the batch where it is called: two of them
        # share its steps, and a closed one leaves at once.
        def run() -> tuple[int, int, int]:
            batch = BatchEngine(loaded, thread)
            first = generate_inline(batch, *request(0, 30, logprobs=False))
            second = generate_inline(batch, *request(1, 6, logprobs=False))
            next(first)
            events = list(second)
            rest = 0
            for _ in range(3):
                next(first)
                rest += 1
            first.close()
            return len(tokens(events)), batch.statistics().active, rest

        assert thread.run_sync(run) == (6, 0, 3)


class TestSeeds:
    async def test_same_seed_same_tokens_alone_or_batched(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        seeded = request(0, 16, temperature=1.5, top_p=0.9, seed=7)
        unbatched = await solo(thread, loaded, seeded)
        batch = BatchEngine(loaded, thread)
        gate = BatchGate(max_num_seqs=8, max_pending=0)

        alone = Collector(thread, batch, gate, seeded)
        async with deadline() as group:
            group.start_soon(alone.run)

        crowd = [request(i, 12, temperature=1.0, seed=i) for i in range(1, 6)]
        runs = [Collector(thread, batch, gate, req) for req in crowd]
        among = Collector(thread, batch, gate, seeded)
        async with deadline() as group:
            for run in runs[:3]:
                group.start_soon(run.run)
                await run.two_tokens.wait()
            group.start_soon(among.run)
            for run in runs[3:]:
                group.start_soon(run.run)

        assert max_logprob_difference(alone.events, unbatched) <= TOL
        assert max_logprob_difference(among.events, unbatched) <= TOL

        other = Collector(thread, batch, gate, request(0, 16, temperature=1.5, seed=8))
        async with deadline() as group:
            group.start_soon(other.run)
        texts = {"".join(e.text for e in run.events) for run in (alone, other)}
        assert len(texts) == 2


class TestGate:
    async def test_waiting_room_full_is_503(self) -> None:
        gate = BatchGate(max_num_seqs=1, max_pending=1)
        entered = anyio.Event()
        release = anyio.Event()

        async def hold() -> None:
            async with gate.turn():
                entered.set()
                await release.wait()

        async with deadline(10) as group:
            group.start_soon(hold)
            await entered.wait()
            group.start_soon(hold)  # waits
            await anyio.wait_all_tasks_blocked()
            assert gate.waiting == 1
            with pytest.raises(OverloadedError) as caught:
                async with gate.turn():
                    pass  # pragma: no cover
            assert (caught.value.waiting, caught.value.retry_after) == (1, 1)
            release.set()
        assert (gate.active, gate.waiting, gate.busy) == (0, 0, False)

    async def test_cancelled_waiter_gives_up_its_place(self) -> None:
        gate = BatchGate(max_num_seqs=1, max_pending=4)
        order: list[str] = []
        entered, release = anyio.Event(), anyio.Event()

        async def hold(name: str) -> None:
            async with gate.turn():
                order.append(name)
                entered.set()
                await release.wait()

        async with deadline(10) as group:
            group.start_soon(hold, "first")
            await entered.wait()
            async with anyio.create_task_group() as waiting:
                waiting.start_soon(hold, "cancelled")
                await until(lambda: gate.waiting == 1)
                waiting.cancel_scope.cancel()
            assert gate.waiting == 0
            group.start_soon(hold, "second")
            release.set()
        assert order == ["first", "second"]

    async def test_a_slot_being_handed_over_refuses_nobody(self) -> None:
        # The room is full; the holder leaves, and its slot goes to the one
        # waiting, who has not run yet when the holder asks again at once.
        # That waiter has left the room: the holder waits, not a 503.
        gate = BatchGate(max_num_seqs=1, max_pending=1)
        entered, release = anyio.Event(), anyio.Event()
        order: list[str] = []

        async def holder() -> None:
            async with gate.turn():
                entered.set()
                await release.wait()
            try:
                async with gate.turn():  # no await since the slot was handed
                    order.append("holder again")
            except OverloadedError as error:
                order.append(error.code)

        async def waiter() -> None:
            async with gate.turn():
                order.append("waiter")

        async with deadline(10) as group:
            group.start_soon(holder)
            await entered.wait()
            group.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert gate.waiting == 1
            release.set()
        assert order == ["waiter", "holder again"]

    def test_one_gate_serves_one_event_loop_after_another(self) -> None:
        # Its semaphore belongs to the loop it runs on, not to the first.
        gate = BatchGate(max_num_seqs=1, max_pending=1)

        async def use() -> int:
            async with gate.turn():
                return gate.active

        for backend in ("asyncio", "trio", "asyncio"):
            assert anyio.run(use, backend=backend) == 1
        assert (gate.active, gate.waiting) == (0, 0)

    def test_bounds_are_checked(self) -> None:
        with pytest.raises(ValueError, match="max_num_seqs"):
            BatchGate(max_num_seqs=0, max_pending=1)


async def test_the_engines_stream_matches_solo(
    thread: MLXThread, loaded: LoadedModel
) -> None:
    req = request(2, 4)
    async with BatchEngine(loaded, thread).stream(*req) as stream:
        events = [event async for event in stream]
    assert max_logprob_difference(events, await solo(thread, loaded, req)) <= TOL


@dataclasses.dataclass
class Greedy:
    """A row as sampling sees it: greedy, no alternatives."""

    sampling: SamplingParams
    sampled: int = 0


def greedy(*, logprobs: bool) -> Greedy:
    return Greedy(SamplingParams(0.0, 1.0, 0, seed=0, logprobs=logprobs))


def test_a_step_reads_logprobs_only_for_rows_that_asked(thread: MLXThread) -> None:
    def run() -> tuple[list[Sampled], list[Sampled], bool]:
        logits = mx.array([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
        rows = [greedy(logprobs=False), greedy(logprobs=False)]
        pending = draw(logits, rows, None)
        lean = collect(pending)
        rows[1] = greedy(logprobs=True)
        full = collect(draw(logits, rows, None))
        return lean, full, pending.chosen is None

    lean, full, skipped = thread.run_sync(run)
    assert skipped  # no row asked: the step builds no logprob gather
    assert [s.token for s in lean] == [s.token for s in full] == [1, 0]
    assert all(math.isnan(s.logprob) for s in lean)
    expected = 3.0 - math.log(math.exp(3.0) + 1.0 + math.exp(1.0))
    assert full[1].logprob == pytest.approx(expected, abs=1e-5)


def test_the_position_seed_is_mlx_vlms() -> None:
    # The engine's copy of mlx-vlm's per-position key mix (a private name
    # there): while mlx-vlm has it, the two agree, so seeds reproduce in
    # mlx_vlm.stream_generate.
    import importlib

    from mlx_pinned.server.engine.sampling import position_seed

    ar = importlib.import_module("mlx_vlm.generate.ar")
    theirs = ar._position_seed
    for seed, row, position in [(0, 0, 0), (7, 0, 15), (2**32 - 1, 3, 4095)]:
        assert position_seed(seed, row, position) == theirs(seed, row, position)
