from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
import uvicorn
from hypothesis import HealthCheck, settings

# "ci" is deterministic so a red run can be replayed; "dev" and "nightly" explore.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# tests/compat needs mlx-vlm 0.4.4 in its own environment:
# .ci/compat-mlx-vlm-044.sh runs it there.
collect_ignore = ["compat"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: Any) -> str:
    backend: str = request.param
    return backend


class LifespanFailed(Exception):
    """The app answered ``lifespan.startup.failed``."""


@asynccontextmanager
async def run_lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
    """Drive an ASGI app's lifespan as a server does (httpx.ASGITransport
    does not): start-up before the block, shut-down after it. Yields the
    lifespan state."""
    state: dict[str, Any] = {}
    to_app, app_inbox = anyio.create_memory_object_stream[dict[str, Any]](4)
    app_outbox, from_app = anyio.create_memory_object_stream[dict[str, Any]](4)
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": state}
    failure = None
    reported: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        reported.append(message["type"])
        await app_outbox.send(message)

    async def run() -> None:
        try:
            await app(scope, app_inbox.receive, send)
        except Exception:
            # As uvicorn: an app that reported its failed start-up may raise.
            if "lifespan.startup.failed" not in reported:
                raise

    async with to_app, app_inbox, app_outbox, from_app:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await to_app.send({"type": "lifespan.startup"})
            answer = await from_app.receive()
            if answer["type"] == "lifespan.startup.failed":
                failure = answer.get("message", "")
                tg.cancel_scope.cancel()
            else:
                assert answer["type"] == "lifespan.startup.complete", answer
                try:
                    yield state
                finally:
                    await to_app.send({"type": "lifespan.shutdown"})
                    answer = await from_app.receive()
                    assert answer["type"] == "lifespan.shutdown.complete", answer
    if failure is not None:
        raise LifespanFailed(failure)


@pytest.fixture
def lifespan() -> Any:
    """The :func:`run_lifespan` helper, for tests in any folder."""
    return run_lifespan


@contextmanager
def run_uvicorn(app: Any) -> Iterator[str]:
    """``app`` under uvicorn on a free loopback port, in a thread; yields
    its base URL (``http://127.0.0.1:PORT``)."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def uvicorn_thread() -> Any:
    """The :func:`run_uvicorn` helper, for tests in any folder."""
    return run_uvicorn
