"""Thread-safety properties of MLXThread: DESIGN.md's invariants, under load.

Everything here drives the real executor with real MLX (``mlx[cpu]``); nothing
is faked. Jobs build and evaluate MLX graphs, so a job that ran on the wrong
thread fails with MLX's own "There is no Stream" error, and a lazy array that
escaped the thread fails when the caller reads it.

- :class:`TestExecutorMachine`: a hypothesis state machine that drives one
  MLXThread from three plain threads, an asyncio loop and a trio run at once:
  submit, run_sync, ``await run``, iterate/iterate_sync (left early or read to
  the end), each with or without an exclusive key, cancellation, a job that
  holds the thread, and shutdown.
- Focused properties: FIFO per submitter, the bounded queue, calls from the
  thread to itself, stream interleaving, cancellation, shutdown, statistics.

Every wait is bounded (``WAIT``): running out of it means a hang and fails the
test, and pytest-timeout backs that up. Regressions that can wedge a thread
for good run in a subprocess, so a failure cannot hang the test session.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import pytest
import sniffio
import trio
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mlx_pinned import (
    Exclusive,
    MLXPinnedError,
    MLXThread,
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    StreamAffinityError,
    on_mlx_thread,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Container, Iterator

# Any bounded wait in this module: running out of it means something hangs.
# A held thread stays held longer (2 * WAIT), so a caller that waits for it
# instead of being released runs out of WAIT first.
WAIT = 15.0
# What MLX says when an array or stream is used on a thread it does not belong to.
NO_STREAM = "There is no Stream"

# "ci" (the default, see conftest.py) runs a fixed, modest number of examples so
# the module stays well under a minute; "dev" and "nightly" scale them up.
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def examples(ci: int) -> int:
    """``ci`` examples under the CI profile; under the others, as many times
    more as their ``max_examples`` exceeds hypothesis's default of 100."""
    if _PROFILE == "ci":
        return ci
    return max(ci, ci * settings.default.max_examples // 100)


# -- jobs --------------------------------------------------------------------


class JobError(Exception):
    """Raised by jobs of kind "raise": a user error that must cross unchanged."""


KINDS = ("int", "lazy", "tree", "raise", "nested")


@dataclass(frozen=True)
class Job:
    """What a job computes: ``sum(arange(n) * (k + step))`` in MLX."""

    id: int
    kind: str
    n: int
    k: int

    def total(self, step: int = 0) -> int:
        return (self.k + step) * self.n * (self.n - 1) // 2

    def expected(self) -> object:
        if self.kind == "tree":
            return (self.total(), self.total() + 1)
        return self.total()


class Recorder:
    """Events logged by jobs as they run, each with the logging thread's ident.

    Jobs run one at a time on the MLX thread, so list order is run order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[Any, ...]] = []

    def add(
        self, what: str, job_id: object, a: object = None, b: object = None
    ) -> None:
        with self._lock:
            self._events.append((what, job_id, a, b, threading.get_ident()))

    def events(self) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._events)

    def starts(self, submitter: str, jobs: Container[int] | None = None) -> list[int]:
        """The sequence numbers of ``submitter``'s jobs (of ``jobs`` only, if
        given), in the order they ran."""
        return [
            e[3]
            for e in self.events()
            if e[0] == "start" and e[2] == submitter and (jobs is None or e[1] in jobs)
        ]


def overlapping_holders(
    events: list[tuple[Any, ...]], keys: dict[int, str], streams: Container[int]
) -> list[str]:
    """Where a job or stream started while a stream with its key was open: a
    stream holds its key from its start to its end; a job's run is atomic on
    the thread, so only its start can fall inside another holder."""
    holding: dict[str, int] = {}
    found = []
    for what, job_id, *_ in events:
        key = keys.get(job_id)
        if key is None:
            continue
        if what == "start":
            holder = holding.get(key)
            if holder is not None:
                found.append(f"job {job_id} started while {holder} held {key!r}")
            if job_id in streams:
                holding[key] = job_id
        elif what == "end" and holding.get(key) == job_id:
            del holding[key]
    return found


def lazy_total(n: int, k: int) -> mx.array:
    return (mx.arange(n) * k).sum()


def call_job(
    rec: Recorder, t: MLXThread | Exclusive, job: Job, submitter: str, seq: int
) -> Any:
    """A job: logs its start, then builds an MLX graph and returns its result."""
    rec.add("start", job.id, submitter, seq)
    total = lazy_total(job.n, job.k)
    if job.kind == "raise":
        raise JobError(job.id)
    if job.kind == "lazy":
        return total  # lazy on purpose: the executor must evaluate it here
    if job.kind == "tree":
        return {"total": [total, (total + 1,)]}  # a nest of lazy arrays
    if job.kind == "nested":
        # A call from the thread to itself (with the job's own key, if it
        # has one): must run inline, not deadlock.
        return t.run_sync(nested_job, rec, t, job, job.n % 3 + 1)
    return int(total.item())


def nested_job(rec: Recorder, t: MLXThread | Exclusive, job: Job, depth: int) -> int:
    rec.add("inner", job.id, depth)
    if depth > 1:
        return int(t.run_sync(nested_job, rec, t, job, depth - 1))
    return int(lazy_total(job.n, job.k).item())


def stream_job(
    rec: Recorder, job: Job, submitter: str, seq: int, items: int
) -> Iterator[mx.array]:
    """A generator job: yields lazy arrays; logs its start, items and end."""
    rec.add("start", job.id, submitter, seq)
    how = "closed"
    try:
        for step in range(items):
            rec.add("item", job.id, step)
            yield lazy_total(job.n, job.k + step)
        how = "exhausted"
    finally:
        # Runs on gen.close() too: the thread it logs is where it was closed.
        rec.add("end", job.id, how)


def gate_job(
    rec: Recorder,
    job: Job,
    seq: int,
    started: threading.Event,
    release: threading.Event,
) -> None:
    """Holds the thread until released, so jobs pile up in the queue."""
    rec.add("start", job.id, "main", seq)
    started.set()
    if not release.wait(WAIT * 2):
        raise AssertionError("the gate job was never released")


def shutdown_job(
    rec: Recorder, t: MLXThread, job: Job, seq: int, cancel_futures: bool
) -> None:
    rec.add("start", job.id, "main", seq)
    t.shutdown(wait=True, cancel_futures=cancel_futures)  # wait is moot here


def read_result(job: Job, value: Any) -> object:
    """Read a job's result on the caller's thread: a lazy array fails here."""
    if job.kind == "lazy":
        return int(value.item())
    if job.kind == "tree":
        first, (second,) = value["total"]
        return (int(first.item()), int(second.item()))
    return value


def summary(exc: BaseException) -> tuple[type[BaseException], str]:
    # Keep no exception objects: their tracebacks would hold frames (and stream
    # iterators) alive until some later garbage collection.
    return type(exc), str(exc)


def thread_of(ident: int | None) -> threading.Thread:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread
    raise AssertionError(f"no thread with ident {ident}")


def own_threads() -> list[str]:
    """Live threads, less the worker pools of trio and anyio (they idle out)."""
    pools = ("Trio thread", "AnyIO worker thread")
    return [
        t.name
        for t in threading.enumerate()
        if not (t.daemon and t.name.startswith(pools))
    ]


def stop(t: MLXThread, worker: threading.Thread) -> bool:
    """Shut ``t`` down, waiting a bounded time; whether its thread stopped."""
    t.shutdown(wait=False)
    worker.join(WAIT)
    if not worker.is_alive():
        return True
    # A bug left the worker without its stop sentinel: it would keep this
    # process from exiting (the exit hook joins it), so post the sentinel here
    # and let the test fail instead of the session hanging.
    from mlx_pinned._worker import STOP

    t._worker.queue.put(STOP)
    worker.join(WAIT)
    return False


@contextlib.contextmanager
def running(name: str, **kwargs: Any) -> Iterator[MLXThread]:
    """A started MLXThread, shut down on exit with a bounded wait."""
    t = MLXThread(name=name, **kwargs)
    t.start()
    worker = thread_of(t.ident)
    try:
        yield t
    finally:
        assert stop(t, worker), f"{name} did not stop within {WAIT}s"


class Gate:
    """Holds an MLXThread busy with one job until released."""

    def __init__(self, t: MLXThread) -> None:
        self._started, self._release = threading.Event(), threading.Event()
        self.future = t.submit(self._hold)
        assert self._started.wait(WAIT), "the gate job never started"

    def _hold(self) -> None:
        self._started.set()
        if not self._release.wait(WAIT * 2):
            raise AssertionError("the gate was never released")

    @property
    def holding(self) -> bool:
        """Whether the thread is still held."""
        return not self.future.done()

    def release(self) -> None:
        self._release.set()


def take(it: Any, received: list[int], limit: int, batched: bool) -> None:
    """Read up to ``limit`` items of a blocking stream into ``received`` (a
    batched stream: the batches until ``limit`` items are in)."""
    if limit <= 0:
        return
    for item in it:
        received.extend(int(i.item()) for i in (item if batched else (item,)))
        if len(received) >= limit:
            break


async def atake(it: Any, received: list[int], limit: int, batched: bool) -> None:
    if limit <= 0:
        return
    async for item in it:
        received.extend(int(i.item()) for i in (item if batched else (item,)))
        if len(received) >= limit:
            break


# -- actors: the submitters the state machine drives ----------------------------


class PlainActor:
    """A plain thread that runs commands in order: one submitter."""

    def __init__(self, name: str, failures: list[str]) -> None:
        self.name = name
        self._failures = failures
        self._seq = itertools.count()
        self._commands: queue.SimpleQueue[Callable[[], object] | None] = (
            queue.SimpleQueue()
        )
        # Daemon: if a bug wedges it, the test fails instead of the exit hanging.
        self._thread = threading.Thread(
            target=self._serve, name=f"ts-{name}", daemon=True
        )
        self._thread.start()

    def next_seq(self) -> int:
        return next(self._seq)

    def send(self, command: Callable[[], object]) -> None:
        self._commands.put(command)

    def _serve(self) -> None:
        while (command := self._commands.get()) is not None:
            self._run(command)

    def _run(self, command: Callable[[], object]) -> None:
        try:
            command()
        except BaseException as exc:
            self._failures.append(f"{self.name}: {exc!r}")

    def close(self) -> bool:
        self._commands.put(None)
        self._thread.join(WAIT * 2)
        return not self._thread.is_alive()


class AsyncioActor:
    """An asyncio loop in its own thread; each command becomes a task."""

    name = "asyncio"

    def __init__(self, failures: list[str]) -> None:
        self._failures = failures
        self._seq = itertools.count()
        self.tasks: dict[object, asyncio.Task[None]] = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(),), name="ts-asyncio", daemon=True
        )
        self._thread.start()
        assert self._ready.wait(WAIT)

    def next_seq(self) -> int:
        return next(self._seq)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._inbox: asyncio.Queue[Callable[[], object] | None] = asyncio.Queue()
        self._ready.set()
        while (command := await self._inbox.get()) is not None:
            command()
        if self.tasks:
            _, hung = await asyncio.wait(self.tasks.values(), timeout=WAIT)
            if hung:
                self._failures.append(f"asyncio: {len(hung)} callers never returned")
                for task in hung:
                    task.cancel()
                await asyncio.wait(hung, timeout=WAIT)

    def start(self, key: object, body: Callable[[], Awaitable[object]]) -> None:
        """Run ``body`` as a task of this loop (from any thread)."""
        self.loop.call_soon_threadsafe(
            self._inbox.put_nowait, lambda: self._spawn(key, body)
        )

    def _spawn(self, key: object, body: Callable[[], Awaitable[object]]) -> None:
        self.tasks[key] = self.loop.create_task(self._guard(body))

    async def _guard(self, body: Callable[[], Awaitable[object]]) -> None:
        try:
            await body()
        except asyncio.CancelledError:
            pass  # the machine cancelled it; the body recorded what it saw
        except BaseException as exc:
            self._failures.append(f"asyncio: {exc!r}")

    async def cancel(self, pick: int | None) -> list[object]:
        """Cancel one live caller (``None``: all of them); return those that
        were not released in time."""
        live = [(k, t) for k, t in self.tasks.items() if isinstance(k, int)]
        live = [(k, t) for k, t in live if not t.done()]
        if live and pick is not None:
            live = [live[pick % len(live)]]
        for _, task in live:
            task.cancel()
        if live:
            await asyncio.wait([task for _, task in live], timeout=WAIT)
        return [key for key, task in live if not task.done()]

    def call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        async def call() -> Any:
            return await fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(WAIT)

    def close(self) -> bool:
        self.loop.call_soon_threadsafe(self._inbox.put_nowait, None)
        self._thread.join(WAIT * 2)
        return not self._thread.is_alive()


class TrioActor:
    """A trio run in its own thread; each command becomes a task in a nursery."""

    name = "trio"

    def __init__(self, failures: list[str]) -> None:
        self._failures = failures
        self._seq = itertools.count()
        self.scopes: dict[object, tuple[trio.CancelScope, trio.Event]] = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=trio.run, args=(self._main,), name="ts-trio", daemon=True
        )
        self._thread.start()
        assert self._ready.wait(WAIT)

    def next_seq(self) -> int:
        return next(self._seq)

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel[Any](math.inf)
        self._send = send
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            async with receive:
                async for command in receive:
                    if command is None:
                        break
                    command()
            with trio.move_on_after(WAIT):
                for _, done in list(self.scopes.values()):
                    await done.wait()
            hung = [k for k, (_, done) in self.scopes.items() if not done.is_set()]
            if hung:
                self._failures.append(f"trio: callers {hung} never returned")
                nursery.cancel_scope.cancel()

    def start(self, key: object, body: Callable[[], Awaitable[object]]) -> None:
        trio.from_thread.run_sync(
            self._send.send_nowait,
            lambda: self._spawn(key, body),
            trio_token=self.token,
        )

    def _spawn(self, key: object, body: Callable[[], Awaitable[object]]) -> None:
        scope, done = trio.CancelScope(), trio.Event()
        self.scopes[key] = (scope, done)
        self._nursery.start_soon(self._guard, body, scope, done)

    async def _guard(
        self,
        body: Callable[[], Awaitable[object]],
        scope: trio.CancelScope,
        done: trio.Event,
    ) -> None:
        try:
            with scope:
                await body()
        except Exception as exc:
            self._failures.append(f"trio: {exc!r}")
        finally:
            done.set()

    async def cancel(self, pick: int | None) -> list[object]:
        live = [
            (key, scope, done)
            for key, (scope, done) in self.scopes.items()
            if isinstance(key, int) and not done.is_set()
        ]
        if live and pick is not None:
            live = [live[pick % len(live)]]
        for _, scope, _ in live:
            scope.cancel()
        with trio.move_on_after(WAIT):
            for _, _, done in live:
                await done.wait()
        return [key for key, _, done in live if not done.is_set()]

    def call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        return trio.from_thread.run(fn, trio_token=self.token)

    def close(self) -> bool:
        trio.from_thread.run_sync(self._send.send_nowait, None, trio_token=self.token)
        self._thread.join(WAIT * 2)
        return not self._thread.is_alive()


# -- the state machine -------------------------------------------------------


@dataclass(eq=False)
class Entry:
    """One job as its caller saw it."""

    job: Job
    api: str  # submit, run_sync, run, iterate, iterate_sync, gate, shutdown
    submitter: str
    mode: str = ""  # streams: how the consumer leaves
    items: int = 0  # streams: how many items the generator yields
    stop_after: int = 0  # streams: when a consumer that leaves early leaves
    seq: int | None = None  # set by the submitter right before it enqueues
    future: Future[Any] | None = None
    accepted: bool = False  # certainly enqueued
    cancel_ok: bool = False  # Future.cancel() returned True
    received: list[int] = field(default_factory=list)
    batch: int = 0  # streams: read in batches of this size (0: item by item)
    key: str | None = None  # the exclusive key it was given with
    outcomes: list[tuple[str, Any]] = field(default_factory=list)


MAX_PENDING = 24
PLAIN = 3
LOOPS = ("asyncio", "trio")
SPECS = st.tuples(st.sampled_from(KINDS), st.integers(1, 48), st.integers(-3, 9))
SYNC_MODES = ("full", "close", "with", "drop")
KEYS = st.sampled_from([None, None, "a", "b"])
ASYNC_MODES = ("full", "aclose", "aclosing", "drop")


class ExecutorMachine(RuleBasedStateMachine):
    """One MLXThread, driven at once by three plain threads, an asyncio loop and
    a trio run. Rules only hand work to those submitters, so jobs really run
    concurrently with each other and with the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.threads_before = own_threads()
        self.failures: list[str] = []
        self.rec = Recorder()
        self.t = MLXThread(name="ts-mlx", max_pending=MAX_PENDING)
        self.t.start()
        self.worker = thread_of(self.t.ident)
        self.plain = [PlainActor(f"plain{i}", self.failures) for i in range(PLAIN)]
        self.aio = AsyncioActor(self.failures)
        self.loops: dict[str, AsyncioActor | TrioActor] = {
            "asyncio": self.aio,
            "trio": TrioActor(self.failures),
        }
        self.entries: list[Entry] = []
        self.ids = itertools.count()
        self.main_seq = itertools.count()
        self.gate: threading.Event | None = None
        self.shutdown_requested = False

    def new(
        self,
        spec: tuple[str, int, int],
        api: str,
        submitter: str,
        key: str | None = None,
    ) -> Entry:
        kind, n, k = spec
        entry = Entry(Job(next(self.ids), kind, n, k), api, submitter, key=key)
        self.entries.append(entry)
        return entry

    def runner(self, key: str | None) -> MLXThread | Exclusive:
        return self.t if key is None else self.t.exclusive(key)

    # -- plain threads -------------------------------------------------------

    @rule(
        actor=st.integers(0, PLAIN - 1),
        specs=st.lists(SPECS, min_size=1, max_size=5),
        key=KEYS,
    )
    def submit(
        self, actor: int, specs: list[tuple[str, int, int]], key: str | None
    ) -> None:
        a, t = self.plain[actor], self.runner(key)
        entries = [self.new(spec, "submit", a.name, key) for spec in specs]

        def command() -> None:
            for e in entries:
                e.seq = a.next_seq()
                try:
                    future = t.submit(call_job, self.rec, t, e.job, a.name, e.seq)
                except MLXPinnedError as exc:
                    e.outcomes.append(("refused", summary(exc)))
                else:
                    e.future, e.accepted = future, True

        a.send(command)

    @rule(
        actor=st.integers(0, PLAIN - 1), spec=SPECS, decorated=st.booleans(), key=KEYS
    )
    def run_sync(
        self, actor: int, spec: tuple[str, int, int], decorated: bool, key: str | None
    ) -> None:
        a, t = self.plain[actor], self.runner(key)
        e = self.new(spec, "run_sync", a.name, key)
        call: Callable[..., Any] = (
            on_mlx_thread(thread=self.t, exclusive=key)(call_job).sync
            if decorated
            else functools.partial(t.run_sync, call_job)
        )

        def command() -> None:
            e.seq = a.next_seq()
            try:
                value = call(self.rec, t, e.job, a.name, e.seq)
            except Exception as exc:
                e.outcomes.append(("error", summary(exc)))
            else:
                e.outcomes.append(("value", read_result(e.job, value)))

        a.send(command)

    @rule(
        actor=st.integers(0, PLAIN - 1),
        spec=SPECS,
        items=st.integers(0, 6),
        mode=st.sampled_from(SYNC_MODES),
        stop_after=st.integers(0, 6),
        decorated=st.booleans(),
        batch=st.sampled_from([0, 0, 1, 2, 3]),
        key=KEYS,
    )
    def iterate_sync(
        self,
        actor: int,
        spec: tuple[str, int, int],
        items: int,
        mode: str,
        stop_after: int,
        decorated: bool,
        batch: int,
        key: str | None,
    ) -> None:
        a, t = self.plain[actor], self.runner(key)
        e = self.new(spec, "iterate_sync", a.name, key)
        e.mode, e.items, e.stop_after, e.batch = mode, items, stop_after, batch
        open_stream: Callable[..., Any] = (
            on_mlx_thread(thread=self.t, exclusive=key)(stream_job).sync
            if decorated
            else functools.partial(t.iterate_sync, stream_job)
        )

        def command() -> None:
            e.seq = a.next_seq()
            try:
                it = open_stream(self.rec, e.job, a.name, e.seq, e.items)
                if batch:
                    it = it.batched(batch)
            except MLXPinnedError as exc:
                e.outcomes.append(("refused", summary(exc)))
                return
            e.accepted = True
            limit = e.items + 1 if mode == "full" else stop_after
            try:
                if mode == "with":
                    with it:
                        take(it, e.received, limit, bool(batch))
                else:
                    take(it, e.received, limit, bool(batch))
                    if mode == "close":
                        it.close()
                # "drop": this is the last reference; __del__ closes the stream.
                del it
            except Exception as exc:
                e.outcomes.append(("error", summary(exc)))
            else:
                e.outcomes.append(("done", None))

        a.send(command)

    @rule(pick=st.integers(0, 1 << 16), via=st.none() | st.integers(0, PLAIN - 1))
    def cancel_future(self, pick: int, via: int | None) -> None:
        # Futures still pending: cancelling a finished one proves nothing.
        futures = [
            e
            for e in self.entries
            if e.api == "submit" and e.future and not e.future.done()
        ]
        if not futures:
            return
        e = futures[pick % len(futures)]

        def cancel() -> None:
            assert e.future is not None
            if e.future.cancel():
                e.cancel_ok = True

        if via is None:
            cancel()  # from the main thread, racing the worker
        else:
            self.plain[via].send(cancel)

    # -- event loops -------------------------------------------------------

    @rule(
        loop=st.sampled_from(LOOPS),
        spec=SPECS,
        how=st.sampled_from(["run", "decorated", "run_in_executor"]),
        key=KEYS,
    )
    def await_run(
        self, loop: str, spec: tuple[str, int, int], how: str, key: str | None
    ) -> None:
        actor, t = self.loops[loop], self.runner(key)
        e = self.new(spec, "run", actor.name, key)

        async def body() -> None:
            args = (self.rec, t, e.job, actor.name)
            # No await between taking the sequence number and enqueueing.
            e.seq = actor.next_seq()
            try:
                if how == "run_in_executor" and loop == "asyncio" and key is None:
                    running_loop = asyncio.get_running_loop()
                    job = functools.partial(call_job, *args, e.seq)
                    value = await running_loop.run_in_executor(self.t, job)
                elif how == "decorated":
                    decorated = on_mlx_thread(thread=self.t, exclusive=key)(call_job)
                    value = await decorated(*args, e.seq)
                else:
                    value = await t.run(call_job, *args, e.seq)
            except anyio.get_cancelled_exc_class():
                e.outcomes.append(("cancelled", None))
                raise
            except Exception as exc:
                e.outcomes.append(("error", summary(exc)))
            else:
                e.outcomes.append(("value", read_result(e.job, value)))

        actor.start(e.job.id, body)

    @rule(
        loop=st.sampled_from(LOOPS),
        spec=SPECS,
        items=st.integers(0, 6),
        mode=st.sampled_from(ASYNC_MODES),
        stop_after=st.integers(0, 6),
        decorated=st.booleans(),
        batch=st.sampled_from([0, 0, 1, 2, 3]),
        key=KEYS,
    )
    def iterate(
        self,
        loop: str,
        spec: tuple[str, int, int],
        items: int,
        mode: str,
        stop_after: int,
        decorated: bool,
        batch: int,
        key: str | None,
    ) -> None:
        actor, t = self.loops[loop], self.runner(key)
        e = self.new(spec, "iterate", actor.name, key)
        e.mode, e.items, e.stop_after, e.batch = mode, items, stop_after, batch
        open_stream: Callable[..., Any] = (
            on_mlx_thread(thread=self.t, exclusive=key)(stream_job)
            if decorated
            else functools.partial(t.iterate, stream_job)
        )

        async def body() -> None:
            e.seq = actor.next_seq()
            try:
                it = open_stream(self.rec, e.job, actor.name, e.seq, e.items)
                if batch:
                    it = it.batched(batch)
            except MLXPinnedError as exc:
                e.outcomes.append(("refused", summary(exc)))
                return
            e.accepted = True
            limit = e.items + 1 if mode == "full" else stop_after
            try:
                if mode == "aclosing":
                    async with contextlib.aclosing(it) as stream:
                        await atake(stream, e.received, limit, bool(batch))
                else:
                    await atake(it, e.received, limit, bool(batch))
                    if mode == "aclose":
                        await it.aclose()
                # "drop": this is the last reference; __del__ closes the stream.
                del it
            except anyio.get_cancelled_exc_class():
                e.outcomes.append(("cancelled", None))
                raise
            except Exception as exc:
                e.outcomes.append(("error", summary(exc)))
            else:
                e.outcomes.append(("done", None))

        actor.start(e.job.id, body)

    @rule(loop=st.sampled_from(LOOPS), pick=st.none() | st.integers(0, 1 << 16))
    def cancel_caller(self, loop: str, pick: int | None) -> None:
        """Cancel awaiting tasks (asyncio) or their cancel scopes (trio), one or
        all: callers must be released at once, even while the thread is held."""
        actor = self.loops[loop]
        stuck = actor.call(functools.partial(actor.cancel, pick))
        assert not stuck, (
            f"{loop}: the cancelled callers of jobs {stuck} were not released"
            f" within {WAIT}s (the thread held: {self.gate is not None})"
        )

    # -- the main thread: hold the thread busy, shut down -------------------------

    @precondition(lambda self: self.gate is None and not self.shutdown_requested)
    @rule()
    def hold(self) -> None:
        """A job that holds the thread, so jobs queue up behind it."""
        e = self.new(("gate", 1, 0), "gate", "main")
        e.seq = next(self.main_seq)
        started, release = threading.Event(), threading.Event()
        try:
            e.future = self.t.submit(gate_job, self.rec, e.job, e.seq, started, release)
        except MLXPinnedError as exc:
            e.outcomes.append(("refused", summary(exc)))
            return
        e.accepted = True
        self.gate = release
        deadline = time.monotonic() + WAIT
        # A shutdown sent earlier to a submitter may cancel the gate instead.
        while not started.wait(0.005) and not e.future.done():
            assert time.monotonic() < deadline, "the gate job never started"

    @precondition(lambda self: self.gate is not None)
    @rule()
    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()
        self.gate = None

    # Not too early, so most steps run against a live thread.
    @precondition(lambda self: not self.shutdown_requested and len(self.entries) > 12)
    @rule(
        via=st.sampled_from(["main", "plain", "asyncio", "trio", "job"]),
        cancel_futures=st.booleans(),
    )
    def shutdown(self, via: str, cancel_futures: bool) -> None:
        self.shutdown_requested = True
        t = self.t
        if via == "main":
            t.shutdown(wait=False, cancel_futures=cancel_futures)
        elif via == "plain":
            # Blocks that submitter until the thread is gone.
            self.plain[0].send(
                lambda: t.shutdown(wait=True, cancel_futures=cancel_futures)
            )
        elif via == "job":  # from the thread itself
            e = self.new(("shutdown", 1, 0), "shutdown", "main")
            e.seq = next(self.main_seq)
            try:
                e.future = t.submit(
                    shutdown_job, self.rec, t, e.job, e.seq, cancel_futures
                )
            except MLXPinnedError as exc:
                e.outcomes.append(("refused", summary(exc)))
                t.shutdown(wait=False, cancel_futures=cancel_futures)
            else:
                e.accepted = True
        else:

            async def aclose() -> None:
                await t.aclose(cancel_futures=cancel_futures)

            self.loops[via].start("aclose", aclose)

    # -- invariants ----------------------------------------------------------

    @invariant()
    def jobs_run_once_and_only_on_the_thread(self) -> None:
        events = self.rec.events()
        stray = [e for e in events if e[-1] != self.t.ident]
        assert not stray, f"ran off the MLX thread {self.t.ident}: {stray[:5]}"
        starts = Counter(e[1] for e in events if e[0] == "start")
        twice = [job for job, count in starts.items() if count > 1]
        assert not twice, f"jobs started more than once: {twice}"
        assert not self.failures, self.failures

    @invariant()
    def holders_of_one_key_never_overlap(self) -> None:
        found = self.overlaps()
        assert not found, found[:5]

    def overlaps(self) -> list[str]:
        keys = {e.job.id: e.key for e in self.entries if e.key is not None}
        streams = {e.job.id for e in self.entries if e.api.startswith("iterate")}
        return overlapping_holders(self.rec.events(), keys, streams)

    @invariant()
    def queue_is_bounded(self) -> None:
        pending = self.t.statistics().pending
        assert pending <= MAX_PENDING, f"{pending} jobs queued, max {MAX_PENDING}"

    # -- the end -------------------------------------------------------------

    def teardown(self) -> None:
        problems: list[str] = []
        if self.gate is not None:
            self.gate.set()
        # Every submitter finishes what it was given: every caller returns.
        problems.extend(
            f"{actor.name}: a caller hung for {WAIT * 2}s"
            for actor in [*self.plain, *self.loops.values()]
            if not actor.close()
        )
        # An asyncio task cancelled before its first step never ran its body.
        for e in self.entries:
            task = self.aio.tasks.get(e.job.id) if e.submitter == "asyncio" else None
            if task is not None and task.cancelled() and not e.outcomes:
                e.outcomes.append(("cancelled", None))
        if stop(self.t, self.worker):
            problems += self.check()
        else:
            problems.append(f"the MLX thread did not stop within {WAIT}s")
        problems += self.failures
        # No thread outlives its example (trio's and anyio's pools idle out).
        leaked = sorted(set(own_threads()) - set(self.threads_before))
        if leaked or len(own_threads()) > len(self.threads_before):
            problems.append(f"threads left behind: {leaked or own_threads()}")
        assert not problems, "\n".join(problems)

    def check(self) -> list[str]:
        """After shutdown: check every job and caller, the log and the counters."""
        problems: list[str] = []
        t = self.t
        events = self.rec.events()
        starts = Counter(e[1] for e in events if e[0] == "start")
        ends: defaultdict[int, list[str]] = defaultdict(list)
        produced: defaultdict[int, list[int]] = defaultdict(list)
        for what, job_id, a, _, _ in events:
            if what == "end":
                ends[job_id].append(a)
            elif what == "item":
                produced[job_id].append(a)
        # FIFO per submitter and key: each one's jobs with one key (or none)
        # ran in the order it enqueued them; keyed work waiting for its key
        # lets the submitter's other work pass.
        for submitter, key in {(e.submitter, e.key) for e in self.entries}:
            jobs = {
                e.job.id
                for e in self.entries
                if (e.submitter, e.key) == (submitter, key)
            }
            seqs = self.rec.starts(submitter, jobs)
            if seqs != sorted(set(seqs)):
                problems.append(f"{submitter}, key {key}: ran out of order: {seqs}")
        problems += self.overlaps()

        completed = failed = lower = upper = 0
        closed = MLXThreadClosedError
        for e in self.entries:
            job, ran = e.job, starts[e.job.id] == 1
            where = f"job {job.id} ({e.api} {job.kind} from {e.submitter})"
            if e.api in ("iterate", "iterate_sync"):
                exhausted = ends[job.id] == ["exhausted"]
                completed += exhausted
                if ran and len(ends[job.id]) != 1:
                    problems.append(f"{where}: generator ended {ends[job.id]}")
                if produced[job.id] != list(range(len(produced[job.id]))):
                    problems.append(f"{where}: produced {produced[job.id]}")
                if exhausted and len(produced[job.id]) != e.items:
                    problems.append(f"{where}: exhausted after {produced[job.id]}")
            elif ran:
                completed += job.kind != "raise"
                failed += job.kind == "raise"
            if e.accepted:
                lower += 1
                upper += 1
            if e.future is not None:
                problems += self.check_future(e, where, ran)
                continue
            if len(e.outcomes) != 1:
                problems.append(f"{where}: the caller saw {e.outcomes}")
                continue
            what, detail = e.outcomes[0]
            if what in ("error", "refused") and (
                issubclass(detail[0], StreamAffinityError) or NO_STREAM in detail[1]
            ):
                problems.append(f"{where}: a stream error: {detail}")
            elif what == "refused":
                if ran or detail[0] not in (MLXThreadBusyError, closed):
                    problems.append(f"{where}: refused with {detail}, ran: {ran}")
                if detail[0] is closed and not self.shutdown_requested:
                    problems.append(f"{where}: refused as closed before shutdown")
            elif what == "value":
                if not ran or detail != job.expected():
                    problems.append(f"{where}: got {detail}, ran: {ran}")
                upper += e.api in ("run", "run_sync")
                lower += e.api in ("run", "run_sync")
            elif what == "cancelled":
                # With a sequence number the body ran up to its enqueue (there
                # is no await in between), so the job was accepted.
                accepted = e.api == "run" and e.seq is not None
                upper += accepted
                lower += accepted
            elif what == "error" and detail[0] is JobError:
                if not ran or job.kind != "raise":
                    problems.append(f"{where}: raised {detail}, ran: {ran}")
                upper += e.api in ("run", "run_sync")
                lower += e.api in ("run", "run_sync")
            elif what == "error" and detail[0] is MLXThreadBusyError:
                if ran:
                    problems.append(f"{where}: refused as busy, yet it ran")
            elif what == "error" and detail[0] is closed:
                if not self.shutdown_requested:
                    problems.append(f"{where}: closed error before any shutdown")
                if e.api in ("run", "run_sync"):
                    if ran:
                        problems.append(f"{where}: closed error, yet it ran")
                    upper += 1  # refused at once, or accepted then dropped
            elif what != "done":
                problems.append(f"{where}: unexpected outcome {what} {detail}")
            if e.api in ("iterate", "iterate_sync"):
                problems += self.check_stream(e, where, what, ends[job.id])
        if e_without_seq := [
            e.job.id for e in self.entries if e.accepted and e.seq is None
        ]:
            problems.append(f"accepted without a sequence number: {e_without_seq}")

        stats = t.statistics()
        note(f"statistics: {stats}; expected completed {completed}, failed {failed}")
        if stats.pending or stats.open_streams or stats.running is not None:
            problems.append(f"after shutdown: {stats}")
        if (stats.completed, stats.failed) != (completed, failed):
            problems.append(
                f"completed/failed {stats.completed}/{stats.failed},"
                f" expected {completed}/{failed}"
            )
        ended = stats.completed + stats.failed + stats.cancelled
        if not lower <= ended <= upper:
            problems.append(
                f"{ended} jobs ended by the counters; {lower}..{upper} were accepted"
            )
        return problems

    def check_future(self, e: Entry, where: str, ran: bool) -> list[str]:
        future = e.future
        assert future is not None
        if not future.done():
            return [f"{where}: its future never finished"]
        if future.cancelled():
            return [f"{where}: cancelled, yet it ran"] if ran else []
        if e.cancel_ok:
            return [f"{where}: cancel() returned True, yet the future was not"]
        error = future.exception(timeout=0)
        if isinstance(error, JobError):
            return [] if ran and e.job.kind == "raise" else [f"{where}: {error!r}"]
        if isinstance(error, MLXThreadClosedError):
            # Keyed work still waiting for its key when the thread stops
            # (behind a stream open then, which the end closes) never starts
            # and ends with this error, as documented: at the machine's own
            # end too, not only after a shutdown rule.
            waited = e.key is not None
            if ran or not (self.shutdown_requested or waited):
                return [f"{where}: {error!r}, ran: {ran}"]
            return []
        if error is not None:  # StreamAffinityError included
            return [f"{where}: unexpected {error!r}"]
        value = future.result(timeout=0)
        if e.job.kind in ("gate", "shutdown"):
            return [] if ran else [f"{where}: finished without running"]
        got = read_result(e.job, value)
        if not ran or got != e.job.expected():
            return [f"{where}: result {got!r}, ran: {ran}"]
        return []

    def check_stream(
        self, e: Entry, where: str, what: str, ends: list[str]
    ) -> list[str]:
        expected = [e.job.total(step) for step in range(e.items)]
        if e.received != expected[: len(e.received)]:
            return [f"{where}: received {e.received}, expected {expected}"]
        if what == "done":
            want = e.items if e.mode == "full" else min(e.items, e.stop_after)
            if e.batch and want < e.items:  # whole batches: round up
                want = min(e.items, -(-want // e.batch) * e.batch)
            if len(e.received) != want:
                return [f"{where}: the stream ended early: {e.received}"]
            if e.mode == "full" and ends != ["exhausted"]:
                return [f"{where}: read to the end, yet the generator {ends}"]
        return []


@pytest.mark.slow
class TestExecutorMachine:
    # About 50 ms an example here (2 cores); "nightly" runs 20 times as many.
    @pytest.mark.timeout(110 if _PROFILE == "ci" else 3600)
    def test_invariants_hold(self) -> None:
        run_state_machine_as_test(
            ExecutorMachine,
            settings=settings(
                max_examples=examples(150),
                stateful_step_count=30 if _PROFILE == "ci" else 50,
                suppress_health_check=[HealthCheck.too_slow],
                # No shrinking: a failure here depends on timing as well as on
                # the steps, so replaying it over and over costs minutes and
                # ends in a Flaky error; report the steps that failed instead.
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
            ),
        )


# -- focused properties --------------------------------------------------------

# (operation, job kind) for one submitter; "raise" jobs keep their place too.
OPS = st.tuples(
    st.sampled_from(["submit", "run_sync", "iterate_sync"]), st.sampled_from(KINDS)
)


def perform(
    t: MLXThread,
    rec: Recorder,
    submitter: str,
    ops: list[tuple[str, str]],
    gate: Gate | None = None,
) -> list[tuple[Job, Any]]:
    """Run ``ops`` in order from the calling thread; return each job and how to
    get its outcome. A gate is released before the first blocking call."""
    done: list[tuple[Job, Any]] = []
    for seq, (op, kind) in enumerate(ops):
        job = Job(seq, kind, n=seq + 2, k=3)
        if op == "submit":
            done.append((job, t.submit(call_job, rec, t, job, submitter, seq)))
        elif op == "iterate_sync":
            it = t.iterate_sync(stream_job, rec, job, submitter, seq, 2)
            done.append((job, it))  # read at the end: it is queued in order now
        else:
            if gate is not None:
                gate.release()
            try:
                value = t.run_sync(call_job, rec, t, job, submitter, seq)
            except JobError as exc:
                value = exc
            done.append((job, value))
    return done


def check_outcomes(done: list[tuple[Job, Any]]) -> None:
    for job, outcome in done:
        if isinstance(outcome, Future):
            try:
                outcome = outcome.result(WAIT)
            except JobError as exc:
                outcome = exc
        elif not isinstance(outcome, (JobError, int, dict, mx.array)):
            with outcome:  # a stream of two items
                items = [int(item.item()) for item in outcome]
            assert items == [job.total(0), job.total(1)], job
            continue
        if job.kind == "raise":
            assert isinstance(outcome, JobError), (job, outcome)
        else:
            assert read_result(job, outcome) == job.expected(), (job, outcome)


class TestFIFO:
    """Jobs from one submitter run in the order it submitted them."""

    @settings(max_examples=examples(40))
    @given(ops=st.lists(OPS, min_size=1, max_size=20), held=st.booleans())
    def test_one_submitter_in_order(
        self, ops: list[tuple[str, str]], held: bool
    ) -> None:
        rec = Recorder()
        with running("ts-fifo", max_pending=None) as t:
            # Held: the queue fills before the thread takes anything.
            gate = Gate(t) if held else None
            done = perform(t, rec, "me", ops, gate)
            if gate is not None:
                gate.release()
            check_outcomes(done)
        assert rec.starts("me") == list(range(len(ops)))
        assert all(event[-1] == t.ident for event in rec.events())

    @pytest.mark.slow
    @settings(max_examples=examples(25))
    @given(
        plans=st.lists(st.lists(OPS, min_size=1, max_size=12), min_size=2, max_size=4)
    )
    def test_each_of_many_submitters_in_order(
        self, plans: list[list[tuple[str, str]]]
    ) -> None:
        rec = Recorder()
        errors: list[BaseException] = []
        with running("ts-fifo-many", max_pending=None) as t:
            barrier = threading.Barrier(len(plans))

            def submitter(index: int, plan: list[tuple[str, str]]) -> None:
                try:
                    barrier.wait(WAIT)
                    check_outcomes(perform(t, rec, f"s{index}", plan))
                except BaseException as exc:
                    errors.append(exc)

            threads = [
                threading.Thread(
                    target=submitter, args=(i, plan), name=f"ts-s{i}", daemon=True
                )
                for i, plan in enumerate(plans)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT)
            assert not any(thread.is_alive() for thread in threads), "a submitter hung"
        assert not errors, errors
        for index, plan in enumerate(plans):
            assert rec.starts(f"s{index}") == list(range(len(plan)))
        assert all(event[-1] == t.ident for event in rec.events())


class TestBackpressure:
    """A full thread refuses at once; it never holds more than max_pending."""

    @settings(max_examples=examples(30))
    @given(
        max_pending=st.integers(1, 12),
        submitters=st.integers(1, 4),
        each=st.integers(1, 12),
        streams=st.booleans(),
    )
    def test_queue_never_exceeds_max_pending(
        self, max_pending: int, submitters: int, each: int, streams: bool
    ) -> None:
        accepted: list[Any] = []
        busy: list[None] = []  # a refusal each
        stop, highest = threading.Event(), [0]
        with running("ts-bounded", max_pending=max_pending) as t:
            gate = Gate(t)  # running, so it does not count: the queue is empty

            def observe() -> None:
                while not stop.is_set():
                    highest[0] = max(highest[0], t.statistics().pending)
                    time.sleep(0)

            def submit(i: int) -> None:
                try:
                    if streams and i % 2:
                        accepted.append(t.iterate_sync(range, 3))
                    else:
                        accepted.append(t.submit(lazy_total, i + 1, 2))
                except MLXThreadBusyError:
                    busy.append(None)

            def hammer() -> None:
                barrier.wait(WAIT)
                for i in range(each):
                    submit(i)

            barrier = threading.Barrier(submitters)
            # Daemons, like every helper thread here: a hang fails, never blocks exit.
            observer = threading.Thread(target=observe, name="ts-observer", daemon=True)
            observer.start()
            threads = [
                threading.Thread(target=hammer, name=f"ts-hammer{i}", daemon=True)
                for i in range(submitters)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT)
            # Every submitter is done while the thread is still held: no
            # refusal waited for room.
            assert not any(thread.is_alive() for thread in threads), "a refusal waited"
            assert gate.holding
            stats = t.statistics()
            stop.set()
            observer.join(WAIT)
            total = submitters * each
            # Busy exactly when full: the held thread took nothing meanwhile.
            assert len(accepted) == min(total, max_pending)
            assert len(busy) == total - len(accepted)
            assert stats.pending == len(accepted)
            assert highest[0] <= max_pending
            gate.release()
            for item in accepted:
                if isinstance(item, Future):
                    assert item.result(WAIT).item() >= 0
                else:
                    with item:
                        assert [int(x) for x in item] == [0, 1, 2]
            # Drained: it accepts again.
            assert t.submit(int, 7).result(WAIT) == 7
        stats = t.statistics()
        assert stats.pending == 0
        assert stats.completed == len(accepted) + 2  # and the gate, and int(7)
        assert stats.failed == stats.cancelled == 0


@st.composite
def inline_chains(draw: st.DrawFn) -> list[str]:
    """How each level calls the next; an event loop at most once each, since
    asyncio.run and trio.run refuse to nest in themselves."""
    chain = draw(st.lists(st.sampled_from(["run_sync", "decorated"]), max_size=6))
    for loop in ("asyncio", "trio"):
        if draw(st.booleans()):
            chain.insert(draw(st.integers(0, len(chain))), loop)
    return chain


@pytest.mark.slow
class TestInline:
    """A call from the thread to itself runs inline instead of deadlocking."""

    @pytest.mark.timeout(60)
    @settings(max_examples=examples(30))
    @given(chain=inline_chains())
    def test_calls_from_the_thread_to_itself_nest(self, chain: list[str]) -> None:
        rec = Recorder()
        with running("ts-inline") as t:

            def level(depth: int) -> int:
                rec.add("level", depth)
                if depth == len(chain):
                    return int(lazy_total(depth + 2, 3).item())
                inner = functools.partial(level, depth + 1)
                how = chain[depth]
                if how == "run_sync":
                    return t.run_sync(inner) + 1
                if how == "decorated":
                    return on_mlx_thread(thread=t)(inner).sync() + 1
                if how == "asyncio":  # `await t.run` with a loop on the thread
                    return asyncio.run(t.run(inner)) + 1
                return trio.run(t.run, inner) + 1

            before = t.statistics()
            value = t.submit(level, 0).result(WAIT)  # bounded: a deadlock fails
            after = t.statistics()
        depth = len(chain)
        assert value == Job(0, "int", depth + 2, 3).total() + depth
        events = rec.events()
        assert [event[1] for event in events] == list(range(depth + 1))
        assert all(event[-1] == t.ident for event in events)
        # Only the outer job is a job: inline calls are not counted again.
        assert after.completed == before.completed + 1


def numbered(rec: Recorder, stream: int, count: int) -> Iterator[mx.array]:
    rec.add("start", stream)
    for step in range(count):
        rec.add("item", stream, step)
        yield mx.array(stream * 1000) + step  # lazy: evaluated on the thread
    rec.add("end", stream)


async def read_all(it: Any) -> list[int]:
    return [int(item.item()) async for item in it]


@pytest.mark.anyio
class TestStreams:
    """Concurrent streams interleave item by item and complete in order."""

    @pytest.mark.timeout(60)
    @settings(max_examples=examples(15))
    @given(lengths=st.lists(st.integers(0, 12), min_size=2, max_size=5))
    async def test_concurrent_streams_interleave(self, lengths: list[int]) -> None:
        rec = Recorder()
        with running("ts-streams") as t:
            gate = Gate(t)  # all streams queued before the first turn
            streams = [t.iterate(numbered, rec, i, n) for i, n in enumerate(lengths)]
            gate.release()
            results: dict[int, list[int]] = {}

            async def consume(index: int) -> None:
                results[index] = await read_all(streams[index])

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    for index in range(len(streams)):
                        tg.start_soon(consume, index)
        for index, count in enumerate(lengths):
            assert results[index] == [index * 1000 + step for step in range(count)]
        items = [(e[1], e[2]) for e in rec.events() if e[0] == "item"]
        # Item by item: every stream yields its first item before any yields a
        # second (each turn sends a stream to the back of the queue).
        first_round = [(index, 0) for index, count in enumerate(lengths) if count]
        assert items[: len(first_round)] == first_round
        assert all(event[-1] == t.ident for event in rec.events())

    @pytest.mark.slow
    @pytest.mark.timeout(60)
    @settings(max_examples=examples(15))
    @given(
        short=st.integers(1, 4),
        long=st.integers(24, 48),
        long_first=st.booleans(),
    )
    async def test_long_stream_does_not_starve_short_one(
        self, short: int, long: int, long_first: bool
    ) -> None:
        rec = Recorder()
        finished: list[str] = []
        with running("ts-starve") as t:
            gate = Gate(t)  # started together
            order = [("long", long), ("short", short)]
            if not long_first:
                order.reverse()
            streams = {
                name: t.iterate(numbered, rec, count, count) for name, count in order
            }
            gate.release()

            async def consume(name: str) -> None:
                # A checkpoint an item: an item that is ready is taken without
                # one, so a consumer that always finds the next item in (a
                # busy event loop's) would never let the other one run, and
                # the short stream would wait, parked, for its reader.
                async for _ in streams[name]:
                    await anyio.lowlevel.checkpoint()
                finished.append(name)

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    for name in streams:
                        tg.start_soon(consume, name)
        assert finished == ["short", "long"]
        ends = [e[1] for e in rec.events() if e[0] == "end"]
        assert ends == [short, long]

    @pytest.mark.timeout(60)
    async def test_slow_consumers_never_hold_the_thread(self) -> None:
        with running("ts-slow") as t:
            # Streams whose consumers never come back for more.
            streams = [t.iterate(itertools.count) for _ in range(4)]
            with anyio.fail_after(WAIT):
                for stream in streams:
                    assert await anext(stream) == 0
                values = [await t.run(lazy_total, n, 2) for n in range(1, 20)]
            assert [int(v.item()) for v in values] == [
                Job(0, "int", n, 2).total() for n in range(1, 20)
            ]
            assert t.statistics().open_streams == 4
            with anyio.fail_after(WAIT):
                for stream in streams:
                    await stream.aclose()
            assert t.statistics().open_streams == 0


@pytest.mark.anyio
class TestCancellation:
    """A cancelled caller is released at once; a job not started never starts."""

    @pytest.mark.timeout(60)
    @settings(max_examples=examples(15))
    @given(jobs=st.integers(1, 8), cancel=st.sets(st.integers(0, 7)))
    async def test_cancelled_callers_are_released_and_their_jobs_never_run(
        self, jobs: int, cancel: set[int]
    ) -> None:
        rec = Recorder()
        cancel = {i for i in cancel if i < jobs}
        values: dict[int, object] = {}
        with running("ts-cancel") as t:
            gate = Gate(t)  # every job stays queued until the callers are cancelled
            scopes = [anyio.CancelScope() for _ in range(jobs)]
            returned = [anyio.Event() for _ in range(jobs)]

            seqs = itertools.count()

            async def caller(i: int) -> None:
                with scopes[i]:
                    job = Job(i, "int", i + 2, 1)
                    # Taken right before the enqueue: tasks start in any order.
                    seq = next(seqs)
                    values[i] = await t.run(call_job, rec, t, job, "me", seq)
                returned[i].set()

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    for i in range(jobs):
                        tg.start_soon(caller, i)
                    # The thread's counters have no event to wait on: poll them.
                    while t.statistics().pending < jobs:  # noqa: ASYNC110
                        await anyio.sleep(0.001)
                    for i in cancel:
                        scopes[i].cancel()
                    for i in cancel:
                        await returned[i].wait()
                    # Released while the thread is still busy with the gate.
                    assert gate.holding
                    gate.release()
        assert set(values) == set(range(jobs)) - cancel
        assert {e[1] for e in rec.events()} == set(range(jobs)) - cancel
        assert rec.starts("me") == sorted(rec.starts("me"))
        for i, value in values.items():
            assert value == Job(i, "int", i + 2, 1).total()
        assert t.statistics().cancelled == len(cancel)

    @pytest.mark.timeout(60)
    async def test_cancelled_consumer_inside_aclosing_is_released(self) -> None:
        """``contextlib.aclosing``, as the docs recommend, must not keep a
        cancelled consumer waiting until the busy thread gets to its stream.

        Native cancellation on purpose: asyncio's ``task.cancel()`` is one-shot,
        so the ``aclose()`` that ``aclosing`` runs afterwards is not cancelled
        again, unlike under anyio's (level-triggered) cancel scopes.
        """
        gates: list[Gate] = []
        with running("ts-aclosing") as t:
            busy = anyio.Event()

            async def consume() -> None:
                async with contextlib.aclosing(t.iterate(itertools.count)) as stream:
                    async for _ in stream:
                        if not gates:
                            gates.append(Gate(t))  # the thread is busy from now on
                            busy.set()

            try:
                if sniffio.current_async_library() == "asyncio":
                    task = asyncio.ensure_future(consume())
                    with anyio.fail_after(WAIT):
                        await busy.wait()
                    task.cancel()
                    released = bool((await asyncio.wait([task], timeout=WAIT))[0])
                    released = released and all(gate.holding for gate in gates)
                    for gate in gates:
                        gate.release()
                    await asyncio.wait([task], timeout=WAIT)
                else:
                    async with trio.open_nursery() as nursery:
                        scope = trio.CancelScope()
                        done = trio.Event()

                        async def cancellable() -> None:
                            with scope:
                                await consume()
                            done.set()

                        nursery.start_soon(cancellable)
                        with trio.fail_after(WAIT):
                            await busy.wait()
                        scope.cancel()
                        with trio.move_on_after(WAIT):
                            await done.wait()
                        released = done.is_set() and all(g.holding for g in gates)
            finally:
                for gate in gates:
                    gate.release()
        assert released, "the cancelled consumer waited for the busy thread"


SHUTDOWN_OPS = st.sampled_from(["int", "lazy", "raise", "stream"])


class TestShutdown:
    """Every accepted job ends exactly once at shutdown; nothing hangs."""

    @pytest.mark.slow
    @settings(max_examples=examples(30))
    @given(
        ops=st.lists(SHUTDOWN_OPS, max_size=16),
        held=st.booleans(),
        cancel_futures=st.booleans(),
    )
    def test_every_job_ends_exactly_once(
        self, ops: list[str], held: bool, cancel_futures: bool
    ) -> None:
        rec = Recorder()
        t = MLXThread(name="ts-shutdown", max_pending=None)
        t.start()
        worker = thread_of(t.ident)
        gate = Gate(t) if held else None
        futures: list[tuple[Job, Future[Any]]] = []
        streams: list[tuple[Job, Any]] = []
        for i, kind in enumerate(ops):
            job = Job(i, kind, i + 1, 2)
            if kind == "stream":
                streams.append((job, t.iterate_sync(stream_job, rec, job, "me", i, 5)))
            else:
                futures.append((job, t.submit(call_job, rec, t, job, "me", i)))
        t.shutdown(wait=False, cancel_futures=cancel_futures)
        if gate is not None:
            gate.release()
        assert stop(t, worker), "shutdown hung"
        with pytest.raises(MLXThreadClosedError):
            t.submit(int)
        ran = set(rec.starts("me"))
        for job, future in futures:
            assert future.done()
            if future.cancelled():
                # Queued jobs run unless cancel_futures.
                assert cancel_futures, job
                assert job.id not in ran, job
            elif job.kind == "raise":
                assert isinstance(future.exception(0), JobError)
            else:
                assert read_result(job, future.result(0)) == job.expected()
            if held and cancel_futures:
                assert future.cancelled(), "it was queued behind the gate"
        for job, stream in streams:
            received: list[int] = []
            # Its consumer gets the items produced so far, or the closed error.
            with contextlib.suppress(MLXThreadClosedError):
                take(stream, received, 5 + 1, False)
            assert received == [job.total(step) for step in range(len(received))]
        ends = Counter(e[1] for e in rec.events() if e[0] == "end")
        assert all(ends[job.id] == (job.id in ran) for job, _ in streams)
        assert all(event[-1] == t.ident for event in rec.events())
        stats = t.statistics()
        assert stats.pending == stats.open_streams == 0
        ended = stats.completed + stats.failed + stats.cancelled
        assert ended == len(ops) + held, stats

    @pytest.mark.slow
    @pytest.mark.timeout(60)
    def test_cancel_futures_racing_the_worker_loses_nothing(self) -> None:
        """shutdown(cancel_futures=True) while the worker is taking jobs.

        The race is narrow, so a subprocess repeats it for a few seconds with a
        tiny switch interval; a wedged worker there cannot hang this session.
        """
        script = """
            import os, sys, threading, time
            from mlx_pinned import MLXThread
            sys.setswitchinterval(1e-6)
            deadline, trials = time.monotonic() + 3.0, 0
            while time.monotonic() < deadline:
                trials += 1
                t = MLXThread(name="race", max_pending=None)
                futures = [t.submit(int, i) for i in range(5)]
                try:
                    t.shutdown(wait=False, cancel_futures=True)
                except BaseException as exc:
                    lost = sum(not f.done() for f in futures)
                    print(f"trial {trials}: shutdown raised {exc!r}")
                    print(f"{lost} of 5 futures never finished")
                    sys.stdout.flush()
                    os._exit(1)  # the worker is wedged: do not wait for it
                worker = [w for w in threading.enumerate() if w.ident == t.ident]
                for w in worker:
                    w.join(10)
                if any(w.is_alive() for w in worker) or not all(
                    f.done() for f in futures
                ):
                    print(f"trial {trials}: worker hung or futures lost")
                    sys.stdout.flush()
                    os._exit(1)
            print(f"ok after {trials} trials")
        """
        run_script(script)

    @pytest.mark.timeout(60)
    def test_dropping_a_stream_while_shutting_down_does_not_deadlock(self) -> None:
        """A queued job holds the last reference to a stream's iterator;
        ``cancel_futures`` drops the job, so the iterator's ``__del__`` closes
        the stream from inside shutdown. That must not deadlock."""
        script = """
            import faulthandler, itertools, threading, time
            from mlx_pinned import MLXThread
            faulthandler.dump_traceback_later(5, exit=True)
            t = MLXThread(name="drop")
            it = t.iterate_sync(itertools.count)
            assert next(it) == 0
            deadline = time.monotonic() + 10
            while t.statistics().pending or t.statistics().running:
                assert time.monotonic() < deadline
                time.sleep(0.01)  # let the stream park after its read-ahead
            started, release = threading.Event(), threading.Event()
            t.submit(lambda: (started.set(), release.wait(10)))
            assert started.wait(10)
            t.submit(lambda it=it: None)  # queued; holds the other reference
            del it
            t.shutdown(wait=False, cancel_futures=True)
            release.set()
            t.shutdown(wait=True)
            print("ok")
        """
        run_script(script)


def run_script(script: str) -> None:
    """Run ``script`` in a fresh interpreter; it must print ok and exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    output = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output}"
    assert "ok" in proc.stdout, output


class TestStatistics:
    def test_broken_thread_accounts_for_abandoned_jobs(self) -> None:
        """Jobs abandoned because the initializer raised are no longer pending;
        they count as cancelled (they never started)."""
        go = threading.Event()

        def initializer() -> None:
            assert go.wait(WAIT)
            raise JobError("initializer")

        t = MLXThread(name="ts-broken", initializer=initializer)
        futures = [t.submit(int, i) for i in range(3)]
        go.set()
        for future in futures:
            with pytest.raises(MLXThreadBrokenError):
                future.result(WAIT)
        stats = t.statistics()
        assert stats.pending == 0, stats
        assert stats.completed + stats.failed + stats.cancelled == 3, stats


class TestControls:
    """The checks above can fail: a lazy array read off its thread is caught."""

    def test_a_lazy_result_escaping_the_thread_fails_when_read(self) -> None:
        with running("ts-control", eval_results=False) as t:
            value = t.submit(lazy_total, 8, 3).result(WAIT)
            with pytest.raises(RuntimeError, match=NO_STREAM):
                read_result(Job(0, "lazy", 8, 3), value)
