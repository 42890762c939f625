"""The app with continuous batching on (max_num_seqs > 1), in process."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mlx_pinned.server.http.gate import Place

from .conftest import drive, vision_body
from .kit import Serve, logprobs

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-5  # float32 rounding; cross-talk moves logprobs by 0.1 to 1


def body(index: int, max_tokens: int) -> dict[str, Any]:
    size = 32 + 16 * (index % 4)
    return vision_body(
        max_tokens,
        image_seed=index,
        image_size=(size, size + 16 * (index % 2)),
        prompt=f"Describe picture {index} in {index + 1} words.",
        logprobs=True,
    )


class TestBatchedApp:
    @pytest.mark.slow
    async def test_eight_concurrent_requests_match_their_solo_runs(
        self, serve: Serve
    ) -> None:
        lengths = [6, 12, 9, 4, 16, 7, 10, 5]
        async with serve(max_num_seqs=1) as served:
            alone = [
                logprobs(await served.chat(body(i, n))) for i, n in enumerate(lengths)
            ]
        together: dict[int, list[float]] = {}
        async with serve(max_num_seqs=8) as served:

            async def one(index: int, max_tokens: int) -> None:
                together[index] = logprobs(await served.chat(body(index, max_tokens)))

            async with anyio.create_task_group() as tg:
                for index, max_tokens in enumerate(lengths):
                    tg.start_soon(one, index, max_tokens)
            stats = served.thread.statistics()
        for index, max_tokens in enumerate(lengths):
            assert len(together[index]) == max_tokens
            worst = max(
                abs(a - b) for a, b in zip(alone[index], together[index], strict=True)
            )
            assert worst <= TOLERANCE, (index, worst)
        assert stats.failed == 0
        assert stats.open_streams == 0

    async def test_max_num_seqs_bounds_the_batch(
        self, serve: Serve, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Counted as each request gets its turn, not sampled.
        held: list[int] = []
        turn = Place.turn

        async def counted(place: Place) -> None:
            await turn(place)
            assert place.room is not None
            held.append(place.room.gate.active)

        monkeypatch.setattr(Place, "turn", counted)
        async with serve(max_num_seqs=2) as served:

            async def one(index: int) -> None:
                assert (await served.chat(body(index, 8))).status_code == 200

            async with anyio.create_task_group() as tg:
                for index in range(6):
                    tg.start_soon(one, index)
            peak = served.engine.statistics().peak_active
        assert len(held) == 6
        assert max(held) == 2
        assert peak == 2

    async def test_a_waiting_room_smaller_than_the_batch_refuses_nobody(
        self, serve: Serve
    ) -> None:
        # The MLX thread's queue was bounded by max_pending alone, and the
        # running generations' turns filled it: of 4 requests that never
        # waited (4 slots), 2 got 503.
        async with serve(max_num_seqs=4, max_pending=1) as served:
            statuses: list[int] = []

            async def one(index: int) -> None:
                statuses.append((await served.chat(body(index, 8))).status_code)

            async with anyio.create_task_group() as tg:
                for index in range(4):
                    tg.start_soon(one, index)
        assert statuses == [200] * 4

    async def test_disconnect_mid_batch_frees_its_slot(self, serve: Serve) -> None:
        async with serve(max_num_seqs=2) as served:
            other: dict[str, Any] = {}

            async def steady() -> None:
                other["response"] = await served.chat(body(1, 24))

            async with anyio.create_task_group() as tg:
                tg.start_soon(steady)
                with anyio.fail_after(20):
                    status, sent = await drive(
                        served.app, body(2, 2000) | {"stream": True}, disconnect_after=3
                    )
            await served.thread.run(lambda: None)  # the close turn has run
            stats = served.thread.statistics()
            assert status == 200
            assert len(sent) <= 8  # stopped within a few tokens of leaving
            assert served.app.state.gate.active == 0
            assert stats.open_streams == 0
            assert len(logprobs(other["response"])) == 24  # its neighbour finished
