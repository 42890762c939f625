"""The channel on a group of one (MLX's collectives are the identity there;
groups of two are test_distributed.py's) and the watchdog's bounds."""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from mlx_pinned import MLXThread
from mlx_pinned.server.engine.collectives import Channel, Watchdog


def test_a_message_and_the_reports_come_back_whole() -> None:
    with MLXThread(name="channel") as thread:

        def exchange(message: bytes | None) -> tuple[bytes, list[int]]:
            channel = Channel(mx.distributed.init())
            return channel.exchange(message, 7)

        payload = bytes(range(256)) * 5
        assert thread.run_sync(exchange, payload) == (payload, [7])
        assert thread.run_sync(exchange, b"") == (b"", [7])


class TestWatchdog:
    def test_a_section_past_its_deadline_is_reported_once(self) -> None:
        reported: list[str] = []
        done = threading.Event()

        def on_timeout(what: str) -> None:
            reported.append(what)
            done.set()

        watchdog = Watchdog(on_timeout, interval=0.01)
        watchdog.start()
        with watchdog.watch("a slow step", 0.05):
            assert done.wait(5)
            time.sleep(0.1)  # no second report while it runs on
        watchdog.stop()
        assert reported == ["a slow step took more than 0.05 s"]

    def test_sections_within_their_bound_are_not_reported(self) -> None:
        reported: list[str] = []
        ticks = threading.Semaphore(0)
        watchdog = Watchdog(reported.append, interval=0.01, tick=ticks.release)
        watchdog.start()
        for _ in range(5):
            with watchdog.watch("a quick step", 1.0):
                time.sleep(0.02)
        time.sleep(0.05)  # outside any section: nothing is bounded
        assert all(ticks.acquire(timeout=5) for _ in range(3))  # it ticks meanwhile
        watchdog.stop()
        assert reported == []

    def test_a_failing_tick_does_not_stop_the_watch(self) -> None:
        reported: list[str] = []

        def tick() -> None:
            raise RuntimeError("tick failed")

        watchdog = Watchdog(reported.append, interval=0.01, tick=tick)
        watchdog.start()
        with watchdog.watch("a step", 0.05):
            deadline = time.monotonic() + 5
            while not reported and time.monotonic() < deadline:
                time.sleep(0.01)
        watchdog.stop()
        assert reported == ["a step took more than 0.05 s"]
