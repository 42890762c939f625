from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from concurrent.futures import BrokenExecutor, Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import pytest

from mlx_pinned import (
    CHECKPOINT,
    BlockingCallWarning,
    MLXThread,
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
    SharedModelWarning,
    StreamAffinityError,
    _async_streams,
    _waiters,
    cancel_requested,
    current_default_mlx_thread,
)
from mlx_pinned._streams import Stream

# run_in_executor is asyncio's API; trio has no equivalent to test.
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])
WAIT = 10.0  # generous bound for "soon": a hang fails instead of blocking CI


@pytest.fixture(
    params=[
        "asyncio",
        "trio",
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: Any) -> Any:
    """Here also uvloop, the loop the server runs on under uvicorn."""
    return request.param


@pytest.fixture
def thread() -> Iterator[MLXThread]:
    with MLXThread(name="test-mlx") as t:
        yield t


def block(t: MLXThread) -> tuple[threading.Event, threading.Event, Future[Any]]:
    """Occupy the thread until the returned gate is set."""
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        assert gate.wait(WAIT)

    future = t.submit(hold)
    assert entered.wait(WAIT)
    return entered, gate, future


def ident() -> int:
    return threading.get_ident()


@dataclasses.dataclass
class Held:
    value: Any
    inner: Held | None = None


class TestWhereJobsRun:
    def test_submit_run_sync_and_iterate_sync_run_on_the_thread(
        self, thread: MLXThread
    ) -> None:
        assert thread.submit(ident).result(WAIT) == thread.ident
        assert thread.run_sync(ident) == thread.ident
        assert (
            list(thread.iterate_sync(lambda: (ident() for _ in range(3))))
            == [thread.ident] * 3
        )
        assert thread.ident != threading.get_ident()

    @pytest.mark.anyio
    async def test_run_and_iterate_run_on_the_thread(self, thread: MLXThread) -> None:
        loop_thread = threading.get_ident()
        assert await thread.run(ident) == thread.ident
        seen = [
            item async for item in thread.iterate(lambda: (ident() for _ in range(4)))
        ]
        assert seen == [thread.ident] * 4
        assert loop_thread != thread.ident

    @pytest.mark.anyio
    @ASYNCIO_ONLY
    async def test_run_in_executor(self, thread: MLXThread) -> None:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(thread, ident) == thread.ident

    def test_same_thread_for_every_job(self, thread: MLXThread) -> None:
        idents = {thread.submit(ident).result(WAIT) for _ in range(50)}
        assert idents == {thread.ident}

    def test_started_lazily_on_first_use(self) -> None:
        t = MLXThread()
        assert t.ident is None
        try:
            assert t.run_sync(ident) == t.ident is not None
        finally:
            t.shutdown()

    def test_name(self) -> None:
        with MLXThread(name="named-worker") as t:
            assert t.run_sync(lambda: threading.current_thread().name) == "named-worker"
            assert t.is_current() is False
            assert t.run_sync(t.is_current) is True


class TestResultsAndErrors:
    def test_user_exception_crosses_unchanged_with_traceback(
        self, thread: MLXThread
    ) -> None:
        class Boom(Exception):
            pass

        def explode() -> None:
            raise Boom("inside")

        with pytest.raises(Boom, match="inside") as info:
            thread.run_sync(explode)
        assert "explode" in "".join(traceback.format_tb(info.value.__traceback__))

    @pytest.mark.anyio
    async def test_exception_through_run(self, thread: MLXThread) -> None:
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        assert await thread.run(lambda: 2) == 2  # the thread survived

    @pytest.mark.anyio
    @ASYNCIO_ONLY
    async def test_stop_iteration_does_not_hang_run_in_executor(
        self, thread: MLXThread
    ) -> None:
        def stop() -> None:
            raise StopIteration

        loop = asyncio.get_running_loop()
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(loop.run_in_executor(thread, stop), WAIT)

    def test_results_are_evaluated_on_the_thread(self, thread: MLXThread) -> None:
        # A lazy array from another thread cannot be evaluated here (FACTS.md);
        # the executor evaluates results on its thread, so this one can.
        result = thread.run_sync(lambda: {"x": [mx.arange(4) * 2]})
        assert result["x"][0].tolist() == [0, 2, 4, 6]
        # In dataclasses too, nested, twice (field names are kept per class).
        for _ in range(2):
            held = thread.run_sync(lambda: Held(mx.arange(3) + 1, Held(mx.ones(2) * 3)))
            assert held.value.tolist() == [1, 2, 3]
            assert held.inner is not None
            assert held.inner.value.tolist() == [3.0, 3.0]

    def test_without_eval_results_a_lazy_result_fails_elsewhere(self) -> None:
        # The baseline that proves the previous test tests something.
        with MLXThread(eval_results=False) as t:
            lazy = t.run_sync(lambda: mx.arange(4) * 2)
            with pytest.raises(RuntimeError, match="There is no Stream"):
                lazy.tolist()

    def test_model_evaluated_whole_including_private_members(
        self, thread: MLXThread
    ) -> None:
        import mlx.nn as nn

        class WithTable(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(4, 4)
                self._table = mx.arange(4) * 3  # lazy, not a parameter

            def __call__(self, x: mx.array) -> mx.array:
                return self.linear(x) + self._table

        model = thread.run_sync(WithTable)
        # Forward on the caller's thread works only if nothing lazy escaped.
        assert model(mx.ones(4)).shape == (4,)

    def test_lazy_argument_gives_stream_affinity_error(self, thread: MLXThread) -> None:
        lazy = mx.ones(4) + 1  # built on this thread, not evaluated

        def total(x: mx.array, *, scale: int) -> float:
            return float((x * scale).sum().item())

        with pytest.raises(StreamAffinityError) as info:
            thread.run_sync(total, lazy, scale=2)
        message = str(info.value)
        assert "total" in message
        assert "argument 0" in message
        assert "mx.eval" in message
        assert isinstance(info.value, RuntimeError)
        assert "There is no Stream" in str(info.value.__cause__)
        mx.eval(lazy)  # evaluated where it was built, it crosses fine
        assert thread.run_sync(total, lazy, scale=2) == 16.0

    def test_stream_affinity_error_in_a_stream(self, thread: MLXThread) -> None:
        lazy = mx.ones(2) * 5

        def gen(x: mx.array) -> Iterator[float]:
            yield float(x.sum().item())

        with pytest.raises(StreamAffinityError, match="gen"):
            list(thread.iterate_sync(gen, lazy))

    def test_stream_affinity_error_without_an_argument_at_fault(
        self, thread: MLXThread
    ) -> None:
        hidden = {"lazy": mx.ones(3) * 2}

        def use_global() -> float:
            return float(hidden["lazy"].sum().item())

        with pytest.raises(StreamAffinityError, match=r"use_global.*this MLXThread"):
            thread.run_sync(use_global)

    def test_a_model_loaded_elsewhere_is_told_to_load_through_the_thread(
        self, thread: MLXThread
    ) -> None:
        import mlx.nn as nn

        model = nn.Linear(2, 2)  # its weights are lazy, built on this thread

        def forward(model: nn.Module, x: list[float]) -> list[float]:
            result: list[float] = model(mx.array(x)).tolist()
            return result

        for args, kind in [
            ((model, [1.0, 2.0]), "argument 0 is a model"),
            (((model, "processor"), [1.0, 2.0]), "argument 0 holds a model"),
        ]:
            with pytest.raises(StreamAffinityError) as info:
                thread.run_sync(lambda pair, x: forward(_first(pair), x), *args)
            message = str(info.value)
            assert kind in message
            assert "load the model through this MLXThread" in message
            # Before, it said to evaluate the model where it was built.
            assert "mx.eval" not in message

    @pytest.mark.slow
    def test_an_affinity_error_names_the_mlx_thread_that_owns_the_array(
        self, thread: MLXThread
    ) -> None:
        with MLXThread(name="owner", eval_results=False) as owner:
            lazy = owner.run_sync(lambda: mx.ones(3) * 2)
            with pytest.raises(StreamAffinityError) as info:
                thread.run_sync(lambda x: x.sum().item(), lazy)
        message = str(info.value)
        assert "argument 0 is a lazy array built on MLX thread 'owner'" in message
        assert "mx.eval" in message


def _first(pair: Any) -> Any:
    return pair[0] if isinstance(pair, tuple) else pair


class TestBlockingCallWarning:
    """A blocking call on an event loop's thread holds the whole loop."""

    @pytest.mark.anyio
    async def test_run_sync_on_an_event_loop_warns(self, thread: MLXThread) -> None:
        with pytest.warns(BlockingCallWarning, match="blocks the whole loop") as info:
            assert thread.run_sync(ident) == thread.ident
        assert info[0].filename == __file__  # it points at the call

    @pytest.mark.anyio
    async def test_iterating_a_sync_stream_on_an_event_loop_warns(
        self, thread: MLXThread
    ) -> None:
        with pytest.warns(BlockingCallWarning, match="iterate_sync") as info:
            assert list(thread.iterate_sync(range, 3)) == [0, 1, 2]
        assert info[0].filename == __file__

    @pytest.mark.anyio
    async def test_no_warning_off_the_loop_or_inline(self, thread: MLXThread) -> None:
        # A worker thread of the loop, and the MLX thread itself: no loop there.
        assert await anyio.to_thread.run_sync(thread.run_sync, ident) == thread.ident
        inline = await thread.run(lambda: thread.run_sync(ident))
        assert inline == thread.ident
        assert await anyio.to_thread.run_sync(list, thread.iterate_sync(range, 2))

    def test_no_warning_on_a_plain_thread(self, thread: MLXThread) -> None:
        assert thread.run_sync(ident) == thread.ident  # warnings are errors here
        assert list(thread.iterate_sync(range, 2)) == [0, 1]


def steps(model: object, n: int) -> Iterator[int]:
    yield from range(n)


def pair_steps(pair: tuple[object, str], n: int) -> Iterator[int]:
    yield from range(n)


class TestSharedModelWarning:
    """Two streams open at once with one model and no shared key warn."""

    @staticmethod
    def open_two(
        thread: MLXThread, first: Any, second: Any
    ) -> tuple[Iterator[int], Iterator[int]]:
        one, two = thread.iterate_sync(*first), thread.iterate_sync(*second)
        assert next(one) == 0  # both generators exist now
        assert next(two) == 0
        return one, two

    def test_the_same_model_without_a_key_warns_naming_both(
        self, thread: MLXThread
    ) -> None:
        import mlx.nn as nn

        model = thread.run_sync(nn.Linear, 2, 2)
        with pytest.warns(SharedModelWarning) as info:
            one, two = self.open_two(
                thread, (steps, model, 3), (pair_steps, (model, "processor"), 3)
            )
        assert (list(one), list(two)) == ([1, 2], [1, 2])
        message = str(info[0].message)
        assert "'steps'" in message
        assert "'pair_steps'" in message
        assert "exclusive=model" in message

    def test_a_shared_key_or_other_models_do_not_warn(self, thread: MLXThread) -> None:
        import mlx.nn as nn

        model, other = thread.run_sync(lambda: (nn.Linear(2, 2), nn.Linear(2, 2)))
        keyed = thread.exclusive(model)
        one = keyed.iterate_sync(steps, model, 2)
        assert next(one) == 0
        two = keyed.iterate_sync(steps, model, 2)  # waits for the key
        three = thread.iterate_sync(steps, other, 2)
        assert next(three) == 0  # warnings are errors here
        assert (list(one), list(two), list(three)) == ([1], [0, 1], [1])
        # One after the other is fine too.
        assert list(thread.iterate_sync(steps, model, 2)) == [0, 1]

    def test_made_an_error_it_ends_the_second_stream(self, thread: MLXThread) -> None:
        import mlx.nn as nn

        model = thread.run_sync(nn.Linear, 2, 2)
        first = thread.iterate_sync(steps, model, 3)
        assert next(first) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", SharedModelWarning)
            with pytest.raises(SharedModelWarning):
                next(thread.iterate_sync(steps, model, 3))
        assert list(first) == [1, 2]  # the first stream goes on
        assert thread.statistics().open_streams == 0


class TestGenerationStreamGlobals:
    def test_plain_module_streams_are_repointed_and_restored(self) -> None:
        import sys
        import types

        module = types.ModuleType("mlx_lm._pinned_test_module")
        original = mx.new_stream(mx.cpu)  # plain stream, built on this thread
        module.generation_stream = original  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
        try:

            def use_module_stream() -> list[int]:
                with mx.stream(module.generation_stream):
                    return (mx.arange(3) + 1).tolist()

            # Baseline: this thread's stream is unusable on another thread.
            with ThreadPool() as other:
                with pytest.raises(RuntimeError, match="There is no Stream"):
                    other.call(use_module_stream)
            with MLXThread() as t:
                assert t.run_sync(use_module_stream) == [1, 2, 3]
                assert module.generation_stream is not original  # type: ignore[attr-defined]
            assert module.generation_stream is original  # type: ignore[attr-defined]
        finally:
            del sys.modules[module.__name__]

    def test_module_imported_after_start_is_repointed(self, thread: MLXThread) -> None:
        import sys
        import types

        thread.run_sync(lambda: None)
        module = types.ModuleType("mlx_vlm._pinned_late_module")
        module.generation_stream = mx.new_stream(mx.cpu)  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
        try:

            def use() -> list[int]:
                with mx.stream(module.generation_stream):
                    return (mx.arange(2) * 2).tolist()

            assert thread.run_sync(use) == [0, 2]
        finally:
            del sys.modules[module.__name__]

    def test_two_threads_one_global_owner_then_handover(self) -> None:
        import sys
        import types

        module = types.ModuleType("mlx_vlm._pinned_shared_module")
        original = mx.new_stream(mx.cpu)
        module.generation_stream = original  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module

        def use() -> list[int]:
            with mx.stream(module.generation_stream):
                return (mx.arange(2) + 5).tolist()

        first, second = MLXThread(name="first"), MLXThread(name="second")
        try:
            assert first.run_sync(use) == [5, 6]  # first owns the global
            with pytest.raises(StreamAffinityError) as info:
                second.run_sync(use)  # it did not steal the global
            message = str(info.value)
            assert "generation_stream" in message
            assert "'first'" in message
            assert first.run_sync(use) == [5, 6]  # still works for its owner
            first.shutdown()
            assert module.generation_stream is original  # type: ignore[attr-defined]
            assert second.run_sync(use) == [5, 6]  # handed over
            second.shutdown()
            assert module.generation_stream is original  # type: ignore[attr-defined]
        finally:
            first.shutdown()
            second.shutdown()
            del sys.modules[module.__name__]


class ThreadPool:
    """One plain thread, to show what happens off the MLX thread."""

    def __enter__(self) -> ThreadPool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def call(self, fn: Any) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            finally:
                mx.clear_streams()

        worker = threading.Thread(target=target)
        worker.start()
        worker.join(WAIT)
        if "error" in box:
            raise box["error"]
        return box["value"]


class TestBackpressure:
    def test_full_queue_refuses_at_once(self) -> None:
        with MLXThread(max_pending=2) as t:
            _, gate, running = block(t)
            queued = [t.submit(ident), t.submit(ident)]
            assert t.statistics().pending == 2  # the running job is not counted
            with pytest.raises(MLXThreadBusyError, match="2 jobs queued"):
                t.submit(ident)
            with pytest.raises(MLXThreadBusyError):
                t.iterate_sync(range, 3)
            # Refused while the queue was still full: no wait for room.
            assert not running.done()
            gate.set()
            assert [f.result(WAIT) for f in queued] == [t.ident] * 2
            assert t.submit(ident).result(WAIT) == t.ident  # room again

    @pytest.mark.anyio
    async def test_full_queue_refuses_async_callers(self) -> None:
        with MLXThread(max_pending=1) as t:
            _, gate, _ = block(t)
            queued = t.submit(ident)
            with pytest.raises(MLXThreadBusyError):
                await t.run(ident)
            with pytest.raises(MLXThreadBusyError):
                t.iterate(range, 2)
            gate.set()
            queued.result(WAIT)

    def test_unbounded(self) -> None:
        with MLXThread(max_pending=None) as t:
            _, gate, _ = block(t)
            futures = [t.submit(ident) for _ in range(3000)]
            assert t.statistics().pending == 3000
            gate.set()
            assert {f.result(WAIT) for f in futures} == {t.ident}

    def test_invalid_max_pending(self) -> None:
        with pytest.raises(ValueError, match="max_pending"):
            MLXThread(max_pending=0)


class TestOrderingAndInlineCalls:
    def test_fifo_for_one_submitter(self, thread: MLXThread) -> None:
        order: list[int] = []
        futures = [thread.submit(order.append, i) for i in range(500)]
        for future in futures:
            future.result(WAIT)
        assert order == list(range(500))

    def test_run_sync_on_the_thread_runs_inline(self, thread: MLXThread) -> None:
        def outer() -> tuple[int, int]:
            return ident(), thread.run_sync(lambda: thread.run_sync(ident))

        first, nested = thread.submit(outer).result(WAIT)
        assert first == nested == thread.ident

    def test_submit_from_the_thread_queues_behind(self, thread: MLXThread) -> None:
        order: list[str] = []

        def outer() -> Future[None]:
            follow_up = thread.submit(order.append, "follow-up")
            order.append("outer")
            return follow_up

        thread.submit(outer).result(WAIT).result(WAIT)
        assert order == ["outer", "follow-up"]

    def test_waiting_on_the_thread_for_its_own_future_raises_at_once(
        self, thread: MLXThread
    ) -> None:
        ran: list[str] = []

        def outer() -> str:
            follow_up = thread.submit(ran.append, "follow-up")
            for wait in (follow_up.result, follow_up.exception):
                with pytest.raises(MLXThreadDeadlockError, match="run_sync"):
                    wait(WAIT)
            with pytest.raises(FutureTimeoutError):
                follow_up.result(timeout=0)  # a poll does not wait: allowed
            return "returned"

        assert thread.submit(outer).result(WAIT) == "returned"
        assert thread.run_sync(lambda: ran) == ["follow-up"]  # it still ran
        # Off the thread, and once done, the future is an ordinary one.
        future = thread.submit(lambda: 7)
        assert future.result(WAIT) == 7
        assert thread.run_sync(future.result) == 7

    @pytest.mark.anyio
    async def test_fifo_from_concurrent_tasks(self, thread: MLXThread) -> None:
        order: list[tuple[int, int]] = []

        async def submitter(task: int) -> None:
            for i in range(20):
                await thread.run(order.append, (task, i))

        async with anyio.create_task_group() as tg:
            for task in range(8):
                tg.start_soon(submitter, task)
        for task in range(8):
            assert [i for t, i in order if t == task] == list(range(20))


class TestCancellation:
    def test_cancelled_future_never_runs(self, thread: MLXThread) -> None:
        ran: list[str] = []
        _, gate, _ = block(thread)
        future = thread.submit(ran.append, "no")
        assert future.cancel()
        gate.set()
        thread.submit(ran.append, "yes").result(WAIT)
        assert ran == ["yes"]
        assert thread.statistics().cancelled == 1

    @pytest.mark.anyio
    async def test_cancelled_caller_released_and_job_never_runs(
        self, thread: MLXThread
    ) -> None:
        ran: list[str] = []
        _, gate, _ = block(thread)
        with anyio.move_on_after(0.05) as scope:
            await thread.run(ran.append, "no")
        assert scope.cancelled_caught
        gate.set()
        await thread.run(ran.append, "yes")
        assert ran == ["yes"]

    @pytest.mark.anyio
    async def test_running_job_sees_cancel_requested(self, thread: MLXThread) -> None:
        started, seen, released = (threading.Event() for _ in range(3))
        order: list[str] = []

        def poll() -> str:
            started.set()
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                if cancel_requested():
                    seen.set()
                    # It ends only after its caller was released.
                    released.wait(WAIT)
                    order.append("job ended")
                    return "stopped early"
                time.sleep(0.001)
            return "never told"

        async with anyio.create_task_group() as tg:

            async def caller() -> None:
                await thread.run(poll)

            tg.start_soon(caller)
            await anyio.to_thread.run_sync(started.wait, WAIT)
            tg.cancel_scope.cancel()
        order.append("caller released")
        released.set()
        assert await anyio.to_thread.run_sync(seen.wait, WAIT)
        await thread.run(lambda: None)  # the job has ended
        assert order == ["caller released", "job ended"]  # released at once
        assert cancel_requested() is False  # never true off the thread

    @pytest.mark.anyio
    async def test_closed_loop_or_gone_waiter_does_not_hurt_the_thread(self) -> None:
        # A job whose asyncio loop closed before it finished.
        with MLXThread() as t:
            _, gate, _ = block(t)

            async def start_and_leave() -> None:
                task = asyncio.ensure_future(t.run(ident))
                await asyncio.sleep(0)
                task.cancel()

            runner = threading.Thread(target=asyncio.run, args=(start_and_leave(),))
            runner.start()
            runner.join(WAIT)
            gate.set()
            assert await t.run(ident) == t.ident


def numbers(count: int, log: list[str], name: str = "gen") -> Iterator[int]:
    try:
        for i in range(count):
            log.append(f"{name}:{i}")
            yield i
    finally:
        log.append(f"{name}:closed on {threading.get_ident()}")


class TestStreams:
    @pytest.mark.anyio
    async def test_items_in_order_and_generator_finishes_on_thread(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        assert [i async for i in thread.iterate(numbers, 5, log)] == list(range(5))
        assert log[-1] == f"gen:closed on {thread.ident}"

    @pytest.mark.anyio
    async def test_aclose_closes_generator_on_thread_before_next_item(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        stream = thread.iterate(numbers, 1000, log)
        assert await stream.__anext__() == 0
        await stream.aclose()
        assert log[-1] == f"gen:closed on {thread.ident}"
        produced = [entry for entry in log if not entry.startswith("gen:closed")]
        assert len(produced) <= 3  # at most the read-ahead past the one taken
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert thread.statistics().open_streams == 0

    @pytest.mark.anyio
    async def test_cancelled_consumer_closes_the_generator(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        closed = threading.Event()

        def endless(log: list[str]) -> Iterator[int]:
            try:
                yield from itertools.count()
            finally:
                log.append(f"closed on {threading.get_ident()}")
                closed.set()

        with anyio.CancelScope() as scope:
            async for _ in thread.iterate(endless, log):
                scope.cancel()  # while it waits for the next item
        assert await anyio.to_thread.run_sync(closed.wait, WAIT)
        assert log == [f"closed on {thread.ident}"]

    @pytest.mark.slow
    @pytest.mark.anyio
    async def test_dropped_iterator_closes_the_generator(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        stream = thread.iterate(numbers, 1000, log)
        await stream.__anext__()
        del stream
        gc.collect()
        await thread.run(lambda: None)  # the close turn runs before this job
        assert log[-1] == f"gen:closed on {thread.ident}"

    @pytest.mark.anyio
    async def test_cancelled_close_runs_before_jobs_queued_after_it(
        self, thread: MLXThread, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The thread can be slow right after it wakes the consumer for an
        # item (it lost the GIL to the consumer, say): here it sleeps there.
        # A consumer that takes the item and leaves at once queues no close
        # turn (one is already scheduled), so that turn must be queued before
        # the consumer can see the item, ahead of any job the consumer queues
        # next. (Found as a 1-in-30 failure of the server's disconnect test:
        # the close ran after the next job.)
        make_waiter = _async_streams.async_waiter
        queued_next = threading.Event()

        class SlowAfterWaking:
            def __init__(self) -> None:
                self.inner = make_waiter()

            def wake(self) -> None:
                self.inner.wake()
                if thread.is_current():  # until the consumer queued its job
                    queued_next.wait(WAIT)

            async def wait(self) -> None:
                await self.inner.wait()

        monkeypatch.setattr(_async_streams, "async_waiter", SlowAfterWaking)
        log: list[str] = []
        stream = thread.iterate(numbers, 1000, log)
        with anyio.CancelScope() as scope:
            async for _ in stream:
                scope.cancel()  # the next wait for an item is cancelled
        await stream.aclose()  # returns at once after a cancelled read
        probe = thread.submit(lambda: thread.statistics().open_streams)
        queued_next.set()
        open_then = await anyio.to_thread.run_sync(probe.result, WAIT)
        assert open_then == 0
        assert log[-1] == f"gen:closed on {thread.ident}"

    @pytest.mark.anyio
    async def test_not_started_stream_never_creates_its_generator(
        self, thread: MLXThread
    ) -> None:
        created: list[int] = []

        def gen() -> Iterator[int]:
            created.append(1)
            yield 1

        _, gate, _ = block(thread)
        stream = thread.iterate(gen)
        closing = anyio.Event()

        async def close() -> None:
            await stream.aclose()
            closing.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            await anyio.wait_all_tasks_blocked()  # closing, the thread still held
            gate.set()
        assert closing.is_set()
        assert created == []

    @pytest.mark.anyio
    async def test_slow_consumer_never_holds_the_thread(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        stream = thread.iterate(numbers, 10_000, log)
        assert await stream.__anext__() == 0
        # The consumer stalls; the thread keeps serving other work.
        for _ in range(20):
            assert await thread.run(ident) == thread.ident
        produced = [entry for entry in log if entry.startswith("gen:")]
        assert len(produced) <= 3  # bounded read-ahead, not 10,000
        await stream.aclose()

    @pytest.mark.anyio
    async def test_streams_interleave_and_long_does_not_starve_short(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        finished: list[str] = []

        async def consume(name: str, count: int) -> None:
            # A checkpoint an item, as test_thread_safety's: a ready item is
            # taken without one, and a consumer that never waits would keep
            # the other from reading (the subject is the thread's order).
            async for _ in thread.iterate(numbers, count, log, name):
                await anyio.lowlevel.checkpoint()
            finished.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "long", 400)
            tg.start_soon(consume, "short", 20)
        assert finished == ["short", "long"]
        first_short = log.index("short:0")
        assert first_short < 10  # the short one started within a few turns

    def test_iterate_sync_close(self, thread: MLXThread) -> None:
        log: list[str] = []
        with thread.iterate_sync(numbers, 100, log) as stream:
            assert next(stream) == 0
        assert log[-1] == f"gen:closed on {thread.ident}"

    def test_stream_error_reaches_consumer_once(self, thread: MLXThread) -> None:
        def broken() -> Iterator[int]:
            yield 1
            raise ValueError("mid-stream")

        stream = thread.iterate_sync(broken)
        assert next(stream) == 1
        with pytest.raises(ValueError, match="mid-stream"):
            next(stream)
        with pytest.raises(StopIteration):
            next(stream)

    def test_consuming_a_stream_on_its_own_thread_is_refused(
        self, thread: MLXThread
    ) -> None:
        def inner() -> None:
            next(thread.iterate_sync(range, 3))

        with pytest.raises(RuntimeError, match="cannot be consumed on that thread"):
            thread.run_sync(inner)


class TestCheckpoint:
    @pytest.mark.anyio
    async def test_a_checkpoint_is_no_item_but_gives_the_thread_away(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        queued = threading.Event()

        def quiet() -> Iterator[Any]:
            for i in range(4):
                if i == 1:
                    queued.wait(WAIT)  # until the other job is in the queue
                log.append(f"turn {i}")
                yield i if i in (0, 3) else CHECKPOINT

        stream = thread.iterate(quiet)
        assert await stream.__anext__() == 0
        other = thread.submit(log.append, "other")
        queued.set()
        assert [i async for i in stream] == [3]
        other.result(WAIT)
        # The checkpoint of turn 1 let the other job run before turn 2.
        assert log == ["turn 0", "turn 1", "other", "turn 2", "turn 3"]

    @pytest.mark.anyio
    async def test_checkpoints_do_not_wake_the_consumer(
        self, thread: MLXThread, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        wakes: list[None] = []
        wake = _waiters.LoopWaiter.wake

        def counting(self: _waiters.LoopWaiter) -> None:
            wakes.append(None)
            wake(self)

        monkeypatch.setattr(_waiters.LoopWaiter, "wake", counting)

        def mostly_quiet() -> Iterator[Any]:
            for _ in range(200):
                yield CHECKPOINT
            yield "end"

        assert [i async for i in thread.iterate(mostly_quiet)] == ["end"]
        assert len(wakes) <= 2  # the item, and the end

    def test_a_sync_consumer_skips_them_too(self, thread: MLXThread) -> None:
        def gen() -> Iterator[Any]:
            yield CHECKPOINT
            yield 1
            yield CHECKPOINT

        assert list(thread.iterate_sync(gen)) == [1]

    @pytest.mark.anyio
    async def test_closing_between_checkpoints_closes_the_generator(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []

        def endless() -> Iterator[Any]:
            try:
                yield 0
                while True:
                    yield CHECKPOINT
            finally:
                log.append("closed")

        stream = thread.iterate(endless)
        assert await stream.__anext__() == 0
        with anyio.fail_after(WAIT):
            await stream.aclose()
        assert log == ["closed"]
        assert thread.statistics().open_streams == 0


class TestReadAhead:
    @pytest.mark.anyio
    async def test_the_thread_reads_up_to_n_items_ahead(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        stream = thread.iterate(numbers, 10_000, log)
        stream.read_ahead(16)
        assert await stream.__anext__() == 0
        for _ in range(40):  # the consumer stalls; the thread serves others
            assert await thread.run(ident) == thread.ident
        produced = [entry for entry in log if entry.startswith("gen:")]
        # Past the default of 2, and parked at the new limit.
        assert 16 <= len(produced) <= 18
        rest = [await stream.__anext__() for _ in range(20)]
        assert rest == list(range(1, 21))
        await stream.aclose()
        assert log[-1] == f"gen:closed on {thread.ident}"

    @pytest.mark.anyio
    async def test_each_item_still_wakes_the_consumer(self, thread: MLXThread) -> None:
        release = threading.Event()

        def held() -> Iterator[int]:
            yield 1
            release.wait(3 * WAIT)  # longer than the consumer waits below
            yield 2

        stream = thread.iterate(held)
        stream.read_ahead(8)
        with anyio.fail_after(WAIT):
            assert await stream.__anext__() == 1  # not held for 8 items
        release.set()
        assert [i async for i in stream] == [2]

    def test_n_below_one_is_refused(self, thread: MLXThread) -> None:
        stream = thread.iterate(range, 3)
        with pytest.raises(ValueError, match="at least 1"):
            stream.read_ahead(0)
        stream.read_ahead(1)
        del stream


class TestBatched:
    @pytest.mark.anyio
    async def test_full_batches_then_the_rest_in_order(self, thread: MLXThread) -> None:
        log: list[str] = []
        batches = [b async for b in thread.iterate(numbers, 23, log).batched(5)]
        # Woken only for full batches: never a short one before the end.
        assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
        assert [i for b in batches for i in b] == list(range(23))
        assert log[-1] == f"gen:closed on {thread.ident}"

    def test_sync_batches(self, thread: MLXThread) -> None:
        log: list[str] = []
        batches = list(thread.iterate_sync(numbers, 10, log).batched(4))
        assert batches == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
        assert log[-1] == f"gen:closed on {thread.ident}"

    @pytest.mark.anyio
    async def test_reads_at_most_one_batch_ahead(self, thread: MLXThread) -> None:
        log: list[str] = []
        batches = thread.iterate(numbers, 10_000, log).batched(8)
        assert await batches.__anext__() == tuple(range(8))
        for _ in range(20):  # the consumer stalls; the thread serves others
            assert await thread.run(ident) == thread.ident
        produced = [entry for entry in log if entry.startswith("gen:")]
        assert 8 <= len(produced) <= 16
        await batches.aclose()
        assert log[-1] == f"gen:closed on {thread.ident}"

    @pytest.mark.anyio
    async def test_items_before_an_error_come_first(self, thread: MLXThread) -> None:
        def broken() -> Iterator[int]:
            yield from range(7)
            raise ValueError("mid-stream")

        batches = thread.iterate(broken).batched(5)
        assert await batches.__anext__() == (0, 1, 2, 3, 4)
        assert await batches.__anext__() == (5, 6)
        with pytest.raises(ValueError, match="mid-stream"):
            await batches.__anext__()
        with pytest.raises(StopAsyncIteration):
            await batches.__anext__()

    @pytest.mark.anyio
    async def test_switching_to_batches_after_items(self, thread: MLXThread) -> None:
        log: list[str] = []
        stream = thread.iterate(numbers, 12, log)
        assert await stream.__anext__() == 0
        await thread.run(ident)  # the generator is parked at its read-ahead
        with anyio.fail_after(WAIT):
            rest = [b async for b in stream.batched(5)]
        assert rest == [(1, 2, 3, 4, 5), (6, 7, 8, 9, 10), (11,)]

    @pytest.mark.anyio
    async def test_cancelled_while_waiting_closes_the_generator(
        self, thread: MLXThread
    ) -> None:
        log: list[str] = []
        release = threading.Event()

        def slow() -> Iterator[int]:
            try:
                yield 1
                release.wait(WAIT)
                yield 2
            finally:
                log.append(f"closed on {threading.get_ident()}")

        batches = thread.iterate(slow).batched(10)
        with anyio.move_on_after(0.05) as scope:
            await batches.__anext__()
        assert scope.cancelled_caught
        release.set()
        await batches.aclose()  # returns at once after a cancelled read
        with anyio.fail_after(WAIT):
            while not log:
                await thread.run(ident)
        assert log == [f"closed on {thread.ident}"]
        assert thread.statistics().open_streams == 0

    @pytest.mark.anyio
    async def test_a_batched_stream_still_takes_turns(self, thread: MLXThread) -> None:
        log: list[str] = []
        finished: list[str] = []

        async def long() -> None:
            async for _ in thread.iterate(numbers, 400, log, "long").batched(400):
                pass
            finished.append("long")

        async def short() -> None:
            async for _ in thread.iterate(numbers, 20, log, "short"):
                pass
            finished.append("short")

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            tg.start_soon(short)
        assert sorted(finished) == ["long", "short"]
        # One item per turn: the short stream's first two items are one of
        # the long stream's turns apart, not a batch apart.
        assert log.index("short:0") < 10
        assert log.index("short:1") - log.index("short:0") <= 3

    def test_n_below_one_is_refused(self, thread: MLXThread) -> None:
        with pytest.raises(ValueError, match="at least 1"):
            thread.iterate_sync(range, 3).batched(0)

    def test_consuming_batches_on_their_own_thread_is_refused(
        self, thread: MLXThread
    ) -> None:
        def inner() -> None:
            next(thread.iterate_sync(range, 3).batched(2))

        with pytest.raises(RuntimeError, match="cannot be consumed on that thread"):
            thread.run_sync(inner)


class TestShutdown:
    def test_queued_jobs_run_then_submits_refused(self) -> None:
        t = MLXThread()
        _, gate, _ = block(t)
        futures = [t.submit(ident) for _ in range(10)]
        gate.set()
        t.shutdown(wait=True)
        assert [f.result(0) for f in futures] == [t.ident] * 10
        with pytest.raises(MLXThreadClosedError, match="shut down"):
            t.submit(ident)
        with pytest.raises(MLXThreadClosedError):
            t.start()

    def test_cancel_futures(self) -> None:
        t = MLXThread()
        _, gate, running = block(t)
        futures = [t.submit(ident) for _ in range(5)]
        t.shutdown(wait=False, cancel_futures=True)
        gate.set()
        t.shutdown(wait=True)
        assert running.result(0) is None
        assert all(f.cancelled() for f in futures)
        stats = t.statistics()
        assert stats.cancelled == 5
        assert stats.pending == 0

    @pytest.mark.anyio
    async def test_cancel_futures_releases_awaiting_callers(self) -> None:
        t = MLXThread()
        _, gate, _ = block(t)
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await t.run(ident)
            except MLXThreadClosedError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            assert t.statistics().pending == 3  # all three wait on the thread
            t.shutdown(wait=False, cancel_futures=True)
            gate.set()
        await t.aclose()
        assert len(errors) == 3

    @pytest.mark.anyio
    async def test_open_streams_closed_on_thread_consumer_gets_closed_error(
        self,
    ) -> None:
        t = MLXThread()
        log: list[str] = []
        stream = t.iterate(numbers, 1000, log)
        assert await stream.__anext__() == 0
        await t.aclose()  # does not wait for the consumer
        assert log[-1] == f"gen:closed on {t.ident}"
        with pytest.raises(MLXThreadClosedError):
            await stream.__anext__()

    def test_shutdown_before_start_and_twice(self) -> None:
        t = MLXThread()
        t.shutdown()
        t.shutdown()
        with pytest.raises(MLXThreadClosedError):
            t.submit(ident)

    def test_shutdown_from_a_job_does_not_deadlock(self) -> None:
        t = MLXThread()
        t.submit(t.shutdown).result(WAIT)
        with pytest.raises(MLXThreadClosedError):
            t.submit(ident)
        t.shutdown()

    def test_initializer_and_finalizer_run_on_the_thread(self) -> None:
        calls: list[tuple[str, int]] = []
        t = MLXThread(
            initializer=lambda: calls.append(("init", ident())),
            finalizer=lambda: calls.append(("fini", ident())),
        )
        with t:
            t.run_sync(lambda: calls.append(("job", ident())))
        assert calls == [("init", t.ident), ("job", t.ident), ("fini", t.ident)]


@pytest.fixture
def no_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX streams cannot be made: what the CUDA backend raised in a forked
    child (seen on an H200)."""

    def fail(*args: Any) -> None:
        raise RuntimeError("cudaSetDevice(device_) failed: initialization error")

    monkeypatch.setattr("mlx_pinned._executor.ThreadStream", fail)


class TestBroken:
    def test_failing_initializer_breaks_the_thread(self) -> None:
        def fail() -> None:
            raise OSError("no model here")

        t = MLXThread(initializer=fail)
        with pytest.raises(MLXThreadBrokenError, match="no model here") as info:
            t.run_sync(ident)
        assert isinstance(info.value.__cause__, OSError)
        assert "its initializer raised" in str(info.value)
        with pytest.raises(MLXThreadBrokenError):
            t.submit(ident)
        assert t.closed
        t.shutdown()

    def test_a_broken_thread_fails_as_a_broken_stdlib_executor(self) -> None:
        def fail() -> None:
            raise OSError("no model here")

        t = MLXThread(initializer=fail)
        # What a dead ThreadPoolExecutor raises, so code written for one works.
        with pytest.raises(BrokenExecutor, match="no model here"):
            t.submit(ident).result()
        t.shutdown()

    @pytest.mark.usefixtures("no_stream")
    def test_a_stream_that_cannot_be_made_breaks_the_thread(self) -> None:
        t = MLXThread()
        with pytest.raises(
            MLXThreadBrokenError, match="creating its MLX stream"
        ) as info:
            t.run_sync(ident)
        assert "'spawn'" in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(MLXThreadBrokenError, match="initialization error"):
            t.submit(ident)
        assert t.closed
        t.shutdown()

    @pytest.mark.usefixtures("no_stream")
    def test_a_call_after_the_failure_says_how_it_failed(self) -> None:
        # The thread breaks before the call is queued (a call racing the
        # failure can land either side of it): the refusal still names the
        # step that failed and its hint, not just "broken".
        t = MLXThread()
        t.start()
        assert t._thread is not None
        t._thread.join(WAIT)
        for call in (lambda: t.run_sync(ident), lambda: t.submit(ident)):
            with pytest.raises(MLXThreadBrokenError) as info:
                call()
            assert "failed to start: creating its MLX stream" in str(info.value)
            assert "'spawn'" in str(info.value)
            assert isinstance(info.value.__cause__, RuntimeError)
        t.shutdown()

    @pytest.mark.anyio
    async def test_awaiting_callers_get_broken_error(self) -> None:
        go = threading.Event()

        def fail() -> None:
            go.wait(WAIT)  # until the caller waits for its job
            raise OSError("late failure")

        t = MLXThread(initializer=fail)
        errors: list[BaseException] = []

        async def caller() -> None:
            with pytest.raises(MLXThreadBrokenError) as info:
                await t.run(ident)
            errors.append(info.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            assert t.statistics().pending == 1
            go.set()
        assert len(errors) == 1
        t.shutdown()

    def test_each_job_left_behind_gets_its_own_error(self) -> None:
        # Raised by callers on different threads, one shared exception would
        # collect all their tracebacks.
        go = threading.Event()

        def fail() -> None:
            go.wait(WAIT)
            raise OSError("no model here")

        t = MLXThread(initializer=fail)
        futures = [t.submit(ident) for _ in range(2)]  # queued before it fails
        go.set()
        errors = [f.exception(WAIT) for f in futures]
        assert all(isinstance(e, MLXThreadBrokenError) for e in errors)
        assert errors[0] is not errors[1]
        assert str(errors[0]) == str(errors[1])
        assert all(isinstance(e.__cause__, OSError) for e in errors if e)
        t.shutdown()


class TestStatistics:
    def test_counters(self, thread: MLXThread) -> None:
        thread.run_sync(ident)
        with pytest.raises(ZeroDivisionError):
            thread.run_sync(lambda: 1 / 0)
        list(thread.iterate_sync(range, 3))
        _entered, gate, _ = block(thread)
        stats = thread.statistics()
        assert stats.running == "block.<locals>.hold"
        gate.set()
        thread.run_sync(ident)
        stats = thread.statistics()
        assert (stats.completed, stats.failed, stats.cancelled) == (4, 1, 0)
        assert stats.running is None
        assert stats.pending == 0
        assert stats.busy_time > 0
        assert stats.max_pending == 1024


class TestDefaultThread:
    def test_one_default_until_shut_down(self) -> None:
        first = current_default_mlx_thread()
        assert current_default_mlx_thread() is first
        assert first.run_sync(ident) == first.ident
        first.shutdown()
        second = current_default_mlx_thread()
        assert second is not first
        assert second.run_sync(ident) == second.ident


EXIT_SCRIPT = """
import mlx.core as mx
from mlx_pinned import MLXThread, current_default_mlx_thread

def numbers():
    for i in range(10_000):
        yield mx.array(i) * 2

@mx.compile
def double(x):
    return x * 2

t = MLXThread()
assert t.run_sync(lambda: double(mx.arange(8)).sum().item()) == 56
default = current_default_mlx_thread()
assert default.run_sync(lambda: double(mx.ones(3)).tolist()) == [2.0, 2.0, 2.0]
stream = t.iterate_sync(numbers)
assert next(stream).item() == 0   # abandoned open, never closed
queued = [t.submit(lambda: double(mx.ones(2)).tolist()) for _ in range(5)]
print("ok")
# main returns without shutting anything down
"""

FORK_SCRIPT = """
import os
import warnings
import mlx.core as mx
from mlx_pinned import MLXThreadBrokenError, current_default_mlx_thread

parent = current_default_mlx_thread()
assert parent.run_sync(lambda: (mx.arange(3) + 1).tolist()) == [1, 2, 3]
# Python 3.12+ warns on stderr when a process with threads forks: forking one
# is the point here.
warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
pid = os.fork()
if pid == 0:
    try:
        child = current_default_mlx_thread()
        assert child is not parent
        if mx.default_device().type == mx.gpu:
            # CUDA does not survive fork: the child's thread says so, at once.
            try:
                child.run_sync(lambda: 1)
            except MLXThreadBrokenError as error:
                assert "spawn" in str(error), error
            else:
                os._exit(4)
        else:
            assert child.run_sync(lambda: (mx.arange(3) * 3).tolist()) == [0, 3, 6]
        try:
            parent.run_sync(lambda: 1)
        except MLXThreadBrokenError:
            os._exit(0)
        os._exit(3)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(2)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""


def _run_script(source: str) -> tuple[int, str]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


class TestProcessExit:
    @pytest.mark.slow
    def test_process_that_never_shuts_down_exits_zero_every_time(self) -> None:
        # Without the exit hook the worker blocks interpreter exit (non-daemon),
        # or, as a daemon, dies without mx.clear_streams() and aborts (134).
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda _: _run_script(EXIT_SCRIPT), range(20)))
        failures = [(code, out) for code, out in outcomes if code != 0]
        assert failures == []
        assert all(out.strip() == "ok" for _, out in outcomes)

    def test_forked_child_gets_a_fresh_default_thread(self) -> None:
        code, out = _run_script(FORK_SCRIPT)
        assert (code, out.strip()) == (0, "ok")


class TestShutdownCancellation:
    def test_cancel_futures_tells_the_running_job(self) -> None:
        t = MLXThread()
        started = threading.Event()

        def poll() -> str:
            started.set()
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                if cancel_requested():
                    return "stopped"
                time.sleep(0.001)
            return "never told"

        future = t.submit(poll)
        assert started.wait(WAIT)
        t.shutdown(cancel_futures=True)
        assert future.result(0) == "stopped"

    def test_queued_stream_is_never_started_after_shutdown(self) -> None:
        t = MLXThread()
        log: list[str] = []
        _, gate, _ = block(t)
        stream = t.iterate_sync(numbers, 5, log)
        t.shutdown(wait=False)
        gate.set()
        t.shutdown(wait=True)
        assert log == []  # never created: no prefill wasted
        with pytest.raises(MLXThreadClosedError):
            next(stream)

    @pytest.mark.anyio
    async def test_cancel_futures_gives_stream_consumers_closed_error(self) -> None:
        t = MLXThread()
        log: list[str] = []
        stream = t.iterate(numbers, 1000, log)
        assert await stream.__anext__() == 0
        t.shutdown(wait=True, cancel_futures=True)
        with pytest.raises(MLXThreadClosedError):
            await stream.__anext__()
        assert log[-1] == f"gen:closed on {t.ident}"


class TestHandOffs:
    """What one thread sees of another's work, at the moment it sees it."""

    def test_the_initializer_is_on_the_thread_and_may_call_run_sync(self) -> None:
        seen: list[Any] = []

        def initializer() -> None:
            seen.append(t.is_current())
            if t.is_current():  # else run_sync would wait for itself
                seen.append(t.run_sync(ident))

        t = MLXThread(name="t-init-run-sync", initializer=initializer)
        with t:
            assert t.run_sync(ident) == t.ident
        assert seen == [True, t.ident]

    def test_an_iterator_collected_while_its_lock_is_held_closes_its_stream(
        self, thread: MLXThread, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Garbage collection can run at any allocation, also while the thread
        # holds a stream's lock; if it collects that stream's dropped
        # iterator, the iterator's finalizer asks for a close, taking the
        # same lock on the same thread. Here the collection is forced there:
        # when the thread queues the stream's next turn (under its lock).
        log: list[str] = []
        release = threading.Event()

        def gen() -> Iterator[int]:
            release.wait(WAIT)  # until the iterator is garbage
            yield from numbers(1000, log)

        it = thread.iterate_sync(gen)
        stream = it._stream
        queue, reentrant = thread._worker.queue, []

        class CollectOnTheThread:
            def put(self, item: Any) -> None:
                if thread.is_current() and item is stream and not reentrant:
                    # A plain lock would deadlock in the collection below.
                    reentrant.append(stream.lock.acquire(blocking=False))
                    if reentrant[0]:
                        gc.collect()
                        stream.lock.release()
                queue.put(item)

            def __getattr__(self, name: str) -> Any:
                return getattr(queue, name)

        monkeypatch.setattr(thread._worker, "queue", CollectOnTheThread())
        cycle: list[Any] = [it]
        cycle.append(cycle)
        del it, cycle
        gc.disable()  # no collection before the one on the thread
        try:
            release.set()
            deadline = time.monotonic() + WAIT
            while not log or not log[-1].startswith("gen:closed"):
                assert time.monotonic() < deadline, log
                time.sleep(0.01)
        finally:
            gc.enable()
        assert reentrant == [True]
        assert log[-1] == f"gen:closed on {thread.ident}"
        assert thread.run_sync(lambda: thread.statistics().open_streams) == 0

    def test_cancel_futures_ends_queued_jobs_outside_the_lock(self) -> None:
        # Ending a queued stream takes its lock; a thread holding that lock
        # may be about to queue a turn (taking the executor's lock), so the
        # executor's lock must be free while queued jobs are ended.
        free_then: list[bool] = []
        abandon = Stream.abandon

        def abandon_and_check(self: Stream[Any], error: BaseException) -> None:
            def probe() -> None:
                got = t._worker.lock.acquire(timeout=WAIT)
                free_then.append(got)
                if got:
                    t._worker.lock.release()

            other = threading.Thread(target=probe)
            other.start()
            other.join(WAIT)
            abandon(self, error)

        t = MLXThread(name="t-discard")
        gate = threading.Event()
        t.submit(gate.wait, WAIT)
        queued = t.iterate_sync(numbers, 3, [])
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Stream, "abandon", abandon_and_check)
            t.shutdown(wait=False, cancel_futures=True)
        gate.set()
        t.shutdown(wait=True)
        assert free_then == [True]
        with pytest.raises(MLXThreadClosedError):
            next(queued)

    def test_an_interrupt_after_take_marked_a_turn_still_queues_it(self) -> None:
        # A sync consumer on the main thread can get a KeyboardInterrupt at
        # any bytecode: here right as take() leaves the stream's lock, after
        # marking the parked generator's next turn scheduled. The turn must
        # still be queued, or close() waits for it forever.
        log: list[str] = []

        def gen() -> Iterator[int]:
            try:
                yield from range(1000)
            finally:
                log.append("closed")

        class InterruptOnce:
            def __init__(self, inner: Any) -> None:
                self.inner, self.armed = inner, True

            def __enter__(self) -> bool:
                return bool(self.inner.__enter__())

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)
                if self.armed and not t.is_current():
                    self.armed = False
                    raise KeyboardInterrupt

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        with MLXThread(name="t-interrupt") as t:
            it = t.iterate_sync(gen)
            assert next(it) == 0  # then the thread reads ahead and parks
            stream = it._stream
            assert t.run_sync(lambda: stream.scheduled) is False
            stream.lock = InterruptOnce(stream.lock)  # type: ignore[assignment]
            with pytest.raises(KeyboardInterrupt):
                next(it)
            closer = threading.Thread(target=it.close)
            closer.start()
            closer.join(WAIT)
            assert not closer.is_alive(), "close() waited for a turn never queued"
            assert log == ["closed"]

    def test_a_consumer_woken_at_shutdown_finds_its_generator_closed(self) -> None:
        log: list[str] = []

        def gen() -> Iterator[int]:
            try:
                yield from range(1000)
            finally:
                time.sleep(0.05)  # a slow clean-up
                log.append("closed")

        t = MLXThread(name="t-finish-order")
        it = t.iterate_sync(gen)
        assert next(it) == 0  # then the thread reads ahead and parks
        assert t.run_sync(lambda: len(it._stream.buffer)) == 2
        gate = threading.Event()
        t.submit(gate.wait, WAIT)  # holds the thread
        t.shutdown(wait=False)
        assert next(it) == 1  # queues the stream's next turn, after the stop
        gate.set()
        with pytest.raises(MLXThreadClosedError):
            list(it)  # the items left, then the end
        assert log == ["closed"]  # before its consumer heard of the end
        t.shutdown(wait=True)
