from __future__ import annotations

import functools
import threading
from typing import Any

import anyio
import mlx.core as mx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mlx_pinned import (
    MLXThread,
    MLXThreadClosedError,
    current_default_mlx_thread,
    mlx_lifespan,
    on_mlx_thread,
)
from mlx_pinned.types import MLXLifespan

pytestmark = pytest.mark.anyio


def load_model(scale: int = 2) -> dict[str, Any]:
    # Stands for a model load: MLX work that must happen on the thread.
    return {"loaded_on": threading.get_ident(), "weights": mx.arange(4) * scale}


async def where(request: Request) -> JSONResponse:
    thread: MLXThread = request.state.mlx_thread
    model = request.state.model
    total = await thread.run(lambda: int(model["weights"].sum().item()))
    return JSONResponse(
        {"loaded_on_thread": model["loaded_on"] == thread.ident, "total": total}
    )


class TestAsStarlettesLifespan:
    def test_the_model_is_loaded_on_the_thread_and_in_request_state(self) -> None:
        app = Starlette(
            routes=[Route("/", where)],
            lifespan=mlx_lifespan(startup={"model": functools.partial(load_model, 3)}),
        )
        with TestClient(app) as http:
            assert http.get("/").json() == {"loaded_on_thread": True, "total": 18}
            thread = current_default_mlx_thread()
        assert thread.closed  # stopped with the lifespan

    def test_each_lifespan_gets_a_fresh_run_and_thread(self) -> None:
        app = Starlette(
            routes=[Route("/", where)],
            lifespan=mlx_lifespan(startup={"model": load_model}),
        )
        threads = []
        for _ in range(2):
            with TestClient(app) as http:
                assert http.get("/").json()["total"] == 12
                threads.append(current_default_mlx_thread())
        assert threads[0] is not threads[1]
        assert all(thread.closed for thread in threads)

    def test_uncalled_it_starts_the_default_thread(self) -> None:
        async def ident(request: Request) -> JSONResponse:
            thread: MLXThread = request.state.mlx_thread
            return JSONResponse(await thread.run(threading.get_ident) == thread.ident)

        app = Starlette(routes=[Route("/", ident)], lifespan=mlx_lifespan)
        with TestClient(app) as http:
            assert http.get("/").json() is True

    def test_fastapi(self) -> None:
        api = FastAPI(lifespan=mlx_lifespan(startup={"model": load_model}))

        @api.get("/")
        async def total(request: Request) -> dict[str, int]:
            model = request.state.model
            thread: MLXThread = request.state.mlx_thread
            return {"total": await thread.run(lambda: int(model["weights"].sum()))}

        with TestClient(api) as http:
            assert http.get("/").json() == {"total": 12}


class TestEntered:
    async def test_the_state_holds_the_thread_and_the_results(self) -> None:
        thread = MLXThread()
        run = mlx_lifespan(thread=thread, startup={"model": load_model})
        assert isinstance(run, MLXLifespan)
        async with run as state:
            assert state["mlx_thread"] is thread
            assert state["model"]["loaded_on"] == thread.ident
        assert thread.closed

    async def test_a_decorated_job_runs_inline_on_the_thread(self) -> None:
        thread = MLXThread()
        decorated = on_mlx_thread(thread=thread)(load_model)
        async with mlx_lifespan(thread=thread, startup={"model": decorated}) as state:
            assert state["model"]["loaded_on"] == thread.ident

    async def test_a_failing_job_fails_the_entry_and_stops_the_thread(self) -> None:
        def broken() -> None:
            raise FileNotFoundError("no weights")

        thread = MLXThread()
        with pytest.raises(FileNotFoundError, match="no weights"):
            async with mlx_lifespan(thread=thread, startup={"model": broken}):
                pass  # pragma: no cover
        assert thread.closed

    async def test_an_async_job_is_refused_and_never_run(self) -> None:
        async def load_async() -> None:
            raise AssertionError  # pragma: no cover - closed, never run

        thread = MLXThread()
        with pytest.raises(TypeError, match="pass a plain function"):
            async with mlx_lifespan(thread=thread, startup={"model": load_async}):
                pass  # pragma: no cover
        assert thread.closed

    async def test_a_given_thread_serves_one_lifespan(self) -> None:
        thread = MLXThread()
        lifespan = mlx_lifespan(thread=thread)
        async with lifespan(None):
            pass
        with pytest.raises(MLXThreadClosedError, match="serves one"):
            async with lifespan(None):
                pass  # pragma: no cover

    @pytest.mark.slow
    async def test_a_cancelled_entry_does_not_wait_for_the_job(self) -> None:
        release = threading.Event()
        run = mlx_lifespan(startup={"model": lambda: release.wait(30)})
        try:
            with anyio.fail_after(10), anyio.move_on_after(0.3):
                async with run:
                    pass  # pragma: no cover
            assert run.thread is not None
            assert run.thread.closed
        finally:
            release.set()

    async def test_an_error_in_the_block_still_stops_the_thread(self) -> None:
        thread = MLXThread()
        with pytest.raises(RuntimeError, match="app failed"):
            async with mlx_lifespan(thread=thread):
                raise RuntimeError("app failed")
        assert thread.closed

    async def test_overlapping_lifespans_share_the_default_until_the_last(
        self,
    ) -> None:
        async with mlx_lifespan() as one:
            async with mlx_lifespan() as two:
                assert one["mlx_thread"] is two["mlx_thread"]
            thread: MLXThread = one["mlx_thread"]  # type: ignore[assignment]
            assert not thread.closed
            assert await thread.run(lambda: 3) == 3
        assert thread.closed
