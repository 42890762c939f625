"""Exclusive keys: ``MLXThread.exclusive(key)``.

Work that shares a key never overlaps on its thread; other work still runs
between a keyed stream's items. What waits for a key can be cancelled,
closed, refused by the queue bound, and ended by shutdown, each exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import mlx.nn as nn
import pytest

from mlx_pinned import (
    Exclusive,
    MLXThread,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
)

WAIT = 10.0  # a bound for "soon": a hang fails instead of blocking CI


@pytest.fixture
def mlx_thread() -> Iterator[MLXThread]:
    with MLXThread(name="test-exclusive") as started:
        yield started


def numbers(count: int, log: list[str], name: str) -> Iterator[int]:
    """A stream that logs each item it makes and its end."""
    try:
        for index in range(count):
            log.append(f"{name}:{index}")
            yield index
    finally:
        log.append(f"{name}:end")


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def waiting(mlx_thread: MLXThread) -> dict[object, int]:
    return dict(mlx_thread.statistics().waiting_for_key)


class TestOverlap:
    def test_a_stream_holds_its_key_while_other_work_runs_between_its_items(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")
        stream = model.iterate_sync(numbers, 5, log, "stream")
        assert next(stream) == 0  # it holds "model" now, and stays open
        keyed = model.submit(log.append, "keyed job")
        # Unkeyed work and work with another key finish while it is open.
        assert mlx_thread.submit(log.append, "plain job").result(WAIT) is None
        mlx_thread.exclusive("other").run_sync(log.append, "other key")
        assert not keyed.done()
        assert waiting(mlx_thread) == {"model": 1}
        assert list(stream) == [1, 2, 3, 4]
        assert keyed.result(WAIT) is None
        assert log.index("stream:end") < log.index("keyed job")
        assert log.index("plain job") < log.index("stream:4")
        assert log.index("other key") < log.index("stream:4")
        assert waiting(mlx_thread) == {}

    def test_waiters_for_one_key_run_in_order_once_it_is_free(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")
        stream = model.iterate_sync(numbers, 3, log, "stream")
        assert next(stream) == 0
        keyed = [model.submit(log.append, f"keyed {index}") for index in range(4)]
        plain = mlx_thread.submit(log.append, "plain")
        plain.result(WAIT)
        assert waiting(mlx_thread) == {"model": 4}
        stream.close()
        for future in keyed:
            future.result(WAIT)
        ran = [entry for entry in log if entry.startswith("keyed")]
        assert ran == [f"keyed {index}" for index in range(4)]
        assert log.index("stream:end") < log.index("keyed 0")

    def test_two_keyed_streams_never_interleave_but_plain_ones_do(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")

        async def main() -> None:
            async def read(iterator: Any) -> None:
                async for _ in iterator:
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read, model.iterate(numbers, 4, log, "a"))
                tasks.start_soon(read, model.iterate(numbers, 4, log, "b"))
                tasks.start_soon(read, mlx_thread.iterate(numbers, 8, log, "plain"))

        anyio.run(main)
        keyed = [entry for entry in log if not entry.startswith("plain")]
        first, second = keyed[0][0], "b" if keyed[0][0] == "a" else "a"
        assert keyed == [f"{first}:{index}" for index in range(4)] + [
            f"{first}:end"
        ] + [f"{second}:{index}" for index in range(4)] + [f"{second}:end"]
        # The plain stream ran between the first keyed stream's items.
        assert log.index("plain:0") < log.index(f"{first}:end")

    def test_a_key_is_let_go_when_its_stream_fails_or_its_job_raises(
        self, mlx_thread: MLXThread
    ) -> None:
        model = mlx_thread.exclusive("model")

        def broken() -> Iterator[int]:
            yield 1
            raise ValueError("in the stream")

        stream = model.iterate_sync(broken)
        assert next(stream) == 1
        after = model.submit(lambda: "after")
        with pytest.raises(ValueError, match="in the stream"):
            next(stream)
        assert after.result(WAIT) == "after"
        with pytest.raises(ZeroDivisionError):
            model.run_sync(lambda: 1 / 0)
        assert model.run_sync(lambda: "free") == "free"

    def test_unhashable_keys_compare_by_identity(self, mlx_thread: MLXThread) -> None:
        first, second = nn.Linear(2, 2), nn.Linear(2, 2)  # type: ignore[attr-defined]
        log: list[str] = []
        stream = mlx_thread.exclusive(first).iterate_sync(numbers, 3, log, "first")
        assert next(stream) == 0
        # Another model (equal as a dict, but another object): not excluded.
        mlx_thread.exclusive(second).run_sync(log.append, "second")
        same = mlx_thread.exclusive(first).submit(log.append, "same")
        until(lambda: mlx_thread.statistics().waiting_for_key, "it never waited")
        [(key, count)] = mlx_thread.statistics().waiting_for_key
        assert key is first
        assert count == 1
        assert mlx_thread.exclusive(first).key is first
        stream.close()
        same.result(WAIT)
        assert log.index("second") < log.index("first:end") < log.index("same")

    def test_none_is_not_a_key(self, mlx_thread: MLXThread) -> None:
        with pytest.raises(ValueError, match="cannot be None"):
            mlx_thread.exclusive(None)

    def test_the_handle(self, mlx_thread: MLXThread) -> None:
        handle = mlx_thread.exclusive("model")
        assert isinstance(handle, Exclusive)
        assert handle.thread is mlx_thread
        assert handle.key == "model"
        assert handle.run_sync(threading.get_ident) == mlx_thread.ident
        assert "model" in repr(handle)


class TestCancelWhileWaiting:
    def test_a_cancelled_future_never_runs_and_leaves_the_queue_soon(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")
        stream = model.iterate_sync(numbers, 3, log, "stream")
        assert next(stream) == 0
        future = model.submit(log.append, "never")
        until(lambda: waiting(mlx_thread), "the job never waited")
        assert future.cancel()
        until(lambda: not waiting(mlx_thread), "the cancelled job still waits")
        stats = mlx_thread.statistics()
        assert (stats.pending, stats.cancelled) == (0, 1)
        stream.close()
        assert model.run_sync(lambda: "after") == "after"
        assert "never" not in log

    @pytest.mark.anyio
    async def test_a_cancelled_caller_is_released_at_once(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")
        stream = model.iterate(numbers, 3, log, "stream")
        assert await stream.__anext__() == 0
        # The stream holds the key until closed below: a caller that waited
        # for the key instead of leaving would never be released.
        with anyio.fail_after(WAIT), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(model.run, log.append, "never")
                await anyio.to_thread.run_sync(
                    until, lambda: waiting(mlx_thread), "the call never waited"
                )
                scope.cancel()
        await anyio.to_thread.run_sync(
            until, lambda: not waiting(mlx_thread), "the cancelled call still waits"
        )
        assert mlx_thread.statistics().pending == 0
        await stream.aclose()
        assert await model.run(lambda: "after") == "after"
        assert "never" not in log

    def test_closing_a_stream_that_waits_for_its_key_does_not_wait_for_the_key(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")
        holder = model.iterate_sync(numbers, 3, log, "holder")
        assert next(holder) == 0
        queued = model.iterate_sync(numbers, 3, log, "queued")
        until(lambda: waiting(mlx_thread), "the stream never waited")
        closer = threading.Thread(target=queued.close)
        closer.start()
        closer.join(WAIT)
        assert not closer.is_alive(), "close() waited for the key"
        assert waiting(mlx_thread) == {}
        with pytest.raises(StopIteration):
            next(queued)
        assert not any(entry.startswith("queued") for entry in log)  # never made
        assert mlx_thread.statistics().cancelled == 1
        assert list(holder) == [1, 2]


class TestShutdown:
    @pytest.mark.parametrize("cancel_futures", [False, True])
    def test_work_waiting_for_a_key_ends_once_at_shutdown(
        self, cancel_futures: bool
    ) -> None:
        log: list[str] = []
        mlx_thread = MLXThread(name="test-exclusive-shutdown")
        model = mlx_thread.exclusive("model")
        holder = model.iterate_sync(numbers, 10, log, "holder")
        assert next(holder) == 0
        future = model.submit(log.append, "future")
        stream = model.iterate_sync(numbers, 3, log, "stream")
        blocked: list[BaseException] = []

        def blocking_call() -> None:
            try:
                model.run_sync(log.append, "run_sync")
            except BaseException as exc:
                blocked.append(exc)

        caller = threading.Thread(target=blocking_call)
        caller.start()
        until(lambda: waiting(mlx_thread) == {"model": 3}, "not all waited")
        mlx_thread.shutdown(wait=True, cancel_futures=cancel_futures)
        caller.join(WAIT)
        if cancel_futures:
            assert future.cancelled()
        else:
            with pytest.raises(MLXThreadClosedError):
                future.result(WAIT)
        with pytest.raises(MLXThreadClosedError):
            next(stream)
        assert [type(exc) for exc in blocked] == [MLXThreadClosedError]
        with pytest.raises(MLXThreadClosedError):
            list(holder)
        assert log == ["holder:0", "holder:1", "holder:2", "holder:end"]
        stats = mlx_thread.statistics()
        assert (stats.pending, stats.completed, stats.cancelled) == (0, 0, 4)


class TestBackpressure:
    def test_waiting_keyed_work_counts_against_max_pending(self) -> None:
        log: list[str] = []
        with MLXThread(name="test-exclusive-bound", max_pending=2) as mlx_thread:
            model = mlx_thread.exclusive("model")
            holder = model.iterate_sync(numbers, 3, log, "holder")
            assert next(holder) == 0
            queued = [model.submit(log.append, "a"), model.submit(log.append, "b")]
            until(lambda: waiting(mlx_thread) == {"model": 2}, "not all waited")
            assert mlx_thread.statistics().pending == 2
            with pytest.raises(MLXThreadBusyError):
                mlx_thread.submit(log.append, "refused")
            with pytest.raises(MLXThreadBusyError):
                model.submit(log.append, "refused")
            holder.close()
            for future in queued:
                future.result(WAIT)
            assert "refused" not in log


class TestInline:
    def test_a_holder_calls_its_own_key_inline(self, mlx_thread: MLXThread) -> None:
        model = mlx_thread.exclusive("model")

        def outer() -> tuple[int, int]:
            return threading.get_ident(), model.run_sync(threading.get_ident)

        assert model.run_sync(outer) == (mlx_thread.ident, mlx_thread.ident)
        assert model.submit(outer).result(WAIT) == (mlx_thread.ident,) * 2

    def test_a_stream_calls_its_own_key_inline_between_items(
        self, mlx_thread: MLXThread
    ) -> None:
        model = mlx_thread.exclusive("model")

        def gen() -> Iterator[int]:
            for index in range(3):
                yield model.run_sync(lambda index=index: index * 2)

        assert list(model.iterate_sync(gen)) == [0, 2, 4]

    def test_a_free_key_is_called_inline_from_any_job(
        self, mlx_thread: MLXThread
    ) -> None:
        model = mlx_thread.exclusive("model")
        assert mlx_thread.run_sync(lambda: model.run_sync(lambda: "inline")) == (
            "inline"
        )

    def test_a_key_held_by_an_open_stream_is_refused_inline_at_once(
        self, mlx_thread: MLXThread
    ) -> None:
        log: list[str] = []
        model = mlx_thread.exclusive("model")
        holder = model.iterate_sync(numbers, 3, log, "holder")
        assert next(holder) == 0
        with pytest.raises(MLXThreadDeadlockError, match="submit"):
            mlx_thread.submit(model.run_sync, log.append, "inline").result(WAIT)
        assert "inline" not in log
        holder.close()
