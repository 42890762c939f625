"""Readiness (``/health``) and liveness (``/livez``) through the app."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import anyio
import httpx
import pytest

from mlx_pinned.server.cli import DEMO_MODEL_NAME

from .conftest import MODEL, assert_error, drive, vision_body
from .kit import Serve, mlx_thread_held
from .replicas import replica

pytestmark = pytest.mark.anyio


class TestReadiness:
    async def test_ready_once_loaded(self, serve: Serve) -> None:
        async with serve() as served:
            assert served.app.state.readiness.refusal() is None
            assert (await served.client.get("/health")).status_code == 200

    @pytest.mark.slow
    async def test_not_ready_before_the_models_are_loaded(self, tmp_path: Path) -> None:
        # A real server (the CLI under uvicorn) whose load is held back.
        with replica(tmp_path / "loading.log", gated=True) as loading:
            loading.wait_listening()
            async with httpx.AsyncClient(base_url=loading.url) as client:
                early = await client.get("/health")
                assert_error(early, 503, None, "model_not_loaded")
                assert (await client.get("/livez")).status_code == 200
                loading.open_gate()
                loading.wait_ready()
                ready = await client.get("/health")
                assert ready.status_code == 200
                assert ready.json()["models"][DEMO_MODEL_NAME]["loaded"] is True

    @pytest.mark.slow
    async def test_draining_is_not_ready_and_still_serves(self, serve: Serve) -> None:
        async with serve() as served:
            served.app.state.readiness.drain()
            assert_error(await served.client.get("/health"), 503, None, "shutting_down")
            assert (await served.client.get("/livez")).status_code == 200
            # Balancers that saw /health move away; what reaches it still runs.
            assert (await served.chat(vision_body())).status_code == 200

    async def test_a_failure_is_kept_with_its_reason(self, serve: Serve) -> None:
        async with serve() as served:
            readiness = served.app.state.readiness
            readiness.fail("rank 1 stopped answering", code="rank_lost")
            readiness.fail("a later reason")
            body = assert_error(
                await served.client.get("/health"), 503, None, "rank_lost"
            )
            assert body["message"] == "rank 1 stopped answering"
            assert (await served.client.get("/livez")).status_code == 200

    async def test_a_stopped_thread_is_neither_ready_nor_alive(
        self, serve: Serve
    ) -> None:
        async with serve() as served:
            served.thread.shutdown()
            code = "mlx_thread_unavailable"
            assert_error(await served.client.get("/health"), 503, None, code)
            assert_error(await served.client.get("/livez"), 503, None, code)


class TestLiveness:
    async def test_alive(self, serve: Serve) -> None:
        async with serve() as served:
            response = await served.client.get("/livez")
            assert response.status_code == 200
            assert response.json() == {"status": "alive"}

    async def test_the_probes_need_no_api_key(self, serve: Serve) -> None:
        async with serve(api_key="s3cret") as served:
            assert (await served.client.get("/livez")).status_code == 200
            assert (await served.client.get("/health")).status_code == 200
            assert_error(await served.client.get("/metrics"), 401)

    async def test_probes_are_counted_by_route(self, serve: Serve) -> None:
        async with serve() as served:
            await served.client.get("/livez")
            text = (await served.client.get("/metrics")).text
            assert 'mlx_pinned_requests_total{route="/livez",status="200"} 1.0' in text


async def test_batch_usage_ratio_is_rows_in_use_over_max_num_seqs(
    serve: Serve,
) -> None:
    gauge = f'mlx_pinned_batch_usage_ratio{{model="{MODEL}"}}'
    async with serve(max_num_seqs=4) as served:
        assert f"{gauge} 0.0" in (await served.client.get("/metrics")).text
        started, leave = anyio.Event(), anyio.Event()
        body = vision_body(4000, stream=True)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(
                    partial(drive, started=started, leave=leave), served.app, body
                )
                await started.wait()  # its row decodes
                async with mlx_thread_held(served.thread):  # and stays
                    during = (await served.client.get("/metrics")).text
                leave.set()
        assert f"{gauge} 0.25" in during
        assert f"{gauge} 0.0" in (await served.client.get("/metrics")).text
        seen = []
        async with anyio.create_task_group() as group:
            group.start_soon(served.chat, vision_body(300))
            with anyio.fail_after(30):
                while f"{gauge} 0.25" not in (seen or [""])[-1]:
                    await anyio.sleep(0.005)
                    seen.append((await served.client.get("/metrics")).text)
        assert f"{gauge} 0.0" in (await served.client.get("/metrics")).text
