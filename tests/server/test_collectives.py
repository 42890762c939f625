"""The channel on a group of one (MLX's collectives are the identity there;
groups of two are test_distributed.py's) and the watchdog's bounds."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import collectives
from mlx_pinned.server.engine.collectives import Channel, Watchdog

WAIT = 10.0  # a bound for what must happen soon: running out means a hang


def test_a_message_and_the_reports_come_back_whole() -> None:
    with MLXThread(name="channel") as thread:

        def exchange(message: bytes | None) -> tuple[bytes, list[int]]:
            channel = Channel(mx.distributed.init())
            return channel.exchange(message, 7)

        payload = bytes(range(256)) * 5
        assert thread.run_sync(exchange, payload) == (payload, [7])
        assert thread.run_sync(exchange, b"") == (b"", [7])


class Clock:
    """The watchdog's clock, moved by the test (``time`` as the collectives
    module sees it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    moved = Clock()
    monkeypatch.setattr(collectives, "time", moved)
    return moved


class TestWatchdog:
    """Checks every ``interval`` (real seconds) against a test's clock:
    each waits for the watchdog's ticks, never for a time."""

    def test_a_section_past_its_deadline_is_reported_once(self, clock: Clock) -> None:
        reported: list[str] = []
        done = threading.Event()

        def on_timeout(what: str) -> None:
            reported.append(what)
            done.set()

        watchdog = Watchdog(on_timeout, interval=0.01)
        watchdog.start()
        with watchdog.watch("a slow step", 0.05):
            clock.now += 0.06
            assert done.wait(WAIT)
            # It stops on its own once it reported: no second report while
            # the section runs on.
            watchdog._thread.join(WAIT)
            assert not watchdog._thread.is_alive()
        watchdog.stop()
        assert reported == ["a slow step took more than 0.05 s"]

    def test_sections_within_their_bound_are_not_reported(self, clock: Clock) -> None:
        reported: list[str] = []
        ticks = threading.Semaphore(0)
        watchdog = Watchdog(reported.append, interval=0.01, tick=ticks.release)
        watchdog.start()
        for _ in range(5):
            with watchdog.watch("a quick step", 1.0):
                clock.now += 0.5
                # Two ticks: a whole check ran inside the section.
                assert all(ticks.acquire(timeout=WAIT) for _ in range(2))
        clock.now += 100  # outside any section: nothing is bounded
        assert all(ticks.acquire(timeout=WAIT) for _ in range(3))  # it ticks meanwhile
        watchdog.stop()
        assert reported == []

    def test_a_failing_tick_does_not_stop_the_watch(self, clock: Clock) -> None:
        reported: list[str] = []
        ticked = threading.Event()

        def tick() -> None:
            ticked.set()
            raise RuntimeError("tick failed")

        watchdog = Watchdog(reported.append, interval=0.01, tick=tick)
        watchdog.start()
        with watchdog.watch("a step", 0.05):
            assert ticked.wait(WAIT)  # a tick failed, and the watch goes on
            clock.now += 0.06
            deadline = time.monotonic() + WAIT
            while not reported and time.monotonic() < deadline:
                time.sleep(0.01)
        watchdog.stop()
        assert reported == ["a step took more than 0.05 s"]
