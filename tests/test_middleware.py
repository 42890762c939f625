from __future__ import annotations

import functools
import gc
import threading
import warnings
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import mlx.core as mx
import pytest
from conftest import LifespanFailed, run_lifespan
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from mlx_pinned import (
    MLXPinnedError,
    MLXThread,
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    current_default_mlx_thread,
    on_mlx_thread,
)
from mlx_pinned.middleware import MLXThreadMiddleware

pytestmark = pytest.mark.anyio

WAIT = 10.0  # a bound for "soon": a hang fails instead of blocking CI


def load_model() -> dict[str, Any]:
    # Stands for a model load: MLX work that must happen on the thread.
    return {"loaded_on": threading.get_ident(), "weights": mx.arange(4) * 2}


async def where(request: Request) -> JSONResponse:
    thread: MLXThread = request.state.mlx_thread
    model = request.state.model
    ran_on = await thread.run(threading.get_ident)
    total = await thread.run(lambda: int(model["weights"].sum().item()))
    return JSONResponse(
        {
            "loaded_on_thread": model["loaded_on"] == thread.ident,
            "ran_on_thread": ran_on == thread.ident,
            "total": total,
        }
    )


async def lazy_argument(request: Request) -> JSONResponse:
    lazy = mx.ones(3) * 2  # built on the event loop's thread, never evaluated
    value = await request.state.mlx_thread.run(lambda x: x.sum().item(), lazy)
    return JSONResponse({"value": value})


async def busy(request: Request) -> JSONResponse:
    raise MLXThreadBusyError("queue full: retry later.")


async def closed(request: Request) -> JSONResponse:
    thread: MLXThread = request.state.mlx_thread
    thread.shutdown(wait=False)
    return JSONResponse(await thread.run(threading.get_ident))


async def busy_mid_stream(request: Request) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        yield b"first"
        raise MLXThreadBusyError("too late to answer 503")

    return StreamingResponse(body())


ROUTES = [
    Route("/where", where),
    Route("/lazy", lazy_argument),
    Route("/busy", busy),
    Route("/closed", closed),
    Route("/busy-mid-stream", busy_mid_stream),
]


def starlette_app(**options: Any) -> Starlette:
    options.setdefault("startup", {"model": load_model})
    return Starlette(
        routes=ROUTES, middleware=[Middleware(MLXThreadMiddleware, **options)]
    )


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    )


def assert_refused(response: httpx.Response, status: int, text: str) -> None:
    """The default refusal: plain text, neither JSON nor any API's error shape."""
    assert response.status_code == status
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert text in response.text


class TestStarlette:
    async def test_model_loaded_and_run_on_the_thread(self) -> None:
        app = starlette_app()
        async with run_lifespan(app) as state, client(app) as http:
            response = await http.get("/where")
            thread = state["mlx_thread"]
            assert isinstance(thread, MLXThread)
        assert response.json() == {
            "loaded_on_thread": True,
            "ran_on_thread": True,
            "total": 12,
        }
        assert thread.closed  # the lifespan's end shut it down

    async def test_busy_is_503_with_retry_after(self) -> None:
        app = starlette_app()
        async with run_lifespan(app), client(app) as http:
            response = await http.get("/busy")
        assert_refused(response, 503, "queue full: retry later.")
        assert response.headers["retry-after"] == "1"

    async def test_real_full_queue_is_503(self) -> None:
        thread = MLXThread(max_pending=1)
        app = starlette_app(thread=thread)
        gate, entered = threading.Event(), threading.Event()

        def hold() -> None:
            entered.set()
            gate.wait(10)

        async with run_lifespan(app), client(app) as http:
            thread.submit(hold)  # running
            assert await anyio.to_thread.run_sync(entered.wait, 10)
            thread.submit(gate.wait, 10)  # queued: the queue is full
            response = await http.get("/where")
            gate.set()
        assert_refused(response, 503, "already has 1 jobs queued")
        assert response.headers["retry-after"] == "1"

    async def test_closed_thread_is_503(self) -> None:
        app = starlette_app()
        async with run_lifespan(app), client(app) as http:
            response = await http.get("/closed")
        assert_refused(response, 503, "shut down")
        assert "retry-after" not in response.headers

    async def test_stream_affinity_error_is_500_that_says_why(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        app = starlette_app()
        async with run_lifespan(app), client(app) as http:
            response = await http.get("/lazy")
        assert_refused(response, 500, "an MLX array")
        message = response.text
        assert "used on a thread that does not own it" in message
        # The job and the thread are named in the log, never to the client.
        for detail in ("<lambda>", "mlx-pinned-default"):
            assert detail not in message
            assert detail in caplog.text
        assert "lazy array" in caplog.text

    async def test_a_deadlock_is_a_generic_500_detailed_in_the_log(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def waits_for_itself(request: Request) -> JSONResponse:
            thread: MLXThread = request.state.mlx_thread
            # A job that waits on the thread for a future of the thread.
            await thread.run(lambda: thread.submit(int).result())
            raise AssertionError  # pragma: no cover

        app = Starlette(
            routes=[Route("/", waits_for_itself)],
            middleware=[Middleware(MLXThreadMiddleware)],
        )
        async with run_lifespan(app), client(app) as http:
            response = await http.get("/")
        assert_refused(response, 500, "The server had an error")
        assert "MLX" not in response.text
        assert "MLXThreadDeadlockError" in caplog.text

    async def test_error_after_response_started_is_reraised(self) -> None:
        app = starlette_app()
        async with run_lifespan(app), client(app) as http:
            with pytest.raises(MLXThreadBusyError, match="too late"):
                await http.get("/busy-mid-stream")

    async def test_failed_load_fails_startup_with_the_reason(self) -> None:
        def broken_load() -> None:
            raise FileNotFoundError("no weights in /nowhere")

        app = starlette_app(startup={"model": broken_load})
        with pytest.raises(LifespanFailed, match="FileNotFoundError: no weights"):
            async with run_lifespan(app):
                pass

    async def test_shutdown_drains_in_flight_and_refuses_new(self) -> None:
        release = anyio.Event()
        entered = anyio.Event()

        async def slow(request: Request) -> JSONResponse:
            entered.set()
            await release.wait()
            value = await request.state.mlx_thread.run(lambda: 7)
            return JSONResponse({"value": value})

        app = Starlette(
            routes=[Route("/slow", slow), *ROUTES],
            middleware=[Middleware(MLXThreadMiddleware, startup={"model": load_model})],
        )
        results: dict[str, httpx.Response] = {}
        async with client(app) as http:
            async with anyio.create_task_group() as tg:

                async def call_slow() -> None:
                    results["slow"] = await http.get("/slow")

                async def lifespan_then_shutdown() -> None:
                    async with run_lifespan(app):
                        tg.start_soon(call_slow)
                        await entered.wait()
                    # returns once shut-down completed

                async def late_caller() -> None:
                    await entered.wait()
                    # Served until the shut-down begins, then refused.
                    with anyio.fail_after(WAIT):
                        late = await http.get("/where")
                        while late.status_code == 200:
                            await anyio.sleep(0.001)
                            late = await http.get("/where")
                    results["late"] = late
                    release.set()

                tg.start_soon(lifespan_then_shutdown)
                tg.start_soon(late_caller)
        assert results["slow"].json() == {"value": 7}  # finished, thread alive
        assert_refused(results["late"], 503, "The server is shutting down.")

    @pytest.mark.slow
    async def test_drain_timeout_bounds_shutdown(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        entered = anyio.Event()
        ended: list[str] = []

        async def stuck(request: Request) -> JSONResponse:
            entered.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                ended.append("cancelled")
                raise
            raise AssertionError  # pragma: no cover

        bound = 0.5
        app = Starlette(
            routes=[Route("/stuck", stuck)],
            middleware=[Middleware(MLXThreadMiddleware, drain_timeout=bound)],
        )
        with anyio.fail_after(10):
            async with client(app) as http, anyio.create_task_group() as tg:
                async with run_lifespan(app) as state:
                    tg.start_soon(http.get, "/stuck")
                    await entered.wait()
                    shutdown_began = anyio.current_time()
                took = anyio.current_time() - shutdown_began
                # Shut down while the request still runs (it never ends by
                # itself): it waited the whole drain, not for the request.
                assert ended == []
                assert state["mlx_thread"].closed
                tg.cancel_scope.cancel()
        assert took >= bound
        assert ended == ["cancelled"]  # by the test's task group, not before
        assert "1 requests still running after 0.5 s" in caplog.text

    async def test_an_error_from_a_task_group_is_mapped_too(self) -> None:
        async def grouped(request: Request) -> JSONResponse:
            async with anyio.create_task_group() as group:  # wraps what it raises
                group.start_soon(busy, request)
            return JSONResponse({})  # pragma: no cover

        async def two(request: Request) -> JSONResponse:
            async with anyio.create_task_group() as group:
                group.start_soon(busy, request)
                group.start_soon(busy, request)
            return JSONResponse({})  # pragma: no cover

        app = Starlette(
            routes=[Route("/grouped", grouped), Route("/two", two)],
            middleware=[Middleware(MLXThreadMiddleware)],
        )
        async with run_lifespan(app), client(app) as http:
            response = await http.get("/grouped")  # a 500 before
            assert_refused(response, 503, "queue full")
            assert response.headers["retry-after"] == "1"
            with pytest.raises(BaseException) as info:  # noqa: PT011
                await http.get("/two")  # two errors: not one to map, raised
            assert "ExceptionGroup" in type(info.value).__name__


class TestRefusal:
    """The app supplies the response to an mlx-pinned error."""

    @staticmethod
    def refusal(seen: list[MLXPinnedError], error: MLXPinnedError) -> JSONResponse:
        seen.append(error)
        return JSONResponse({"refused": type(error).__name__}, status_code=529)

    async def test_the_apps_refusal_answers_its_errors(self) -> None:
        seen: list[MLXPinnedError] = []
        app = starlette_app(refusal=functools.partial(self.refusal, seen))
        async with run_lifespan(app), client(app) as http:
            busy = await http.get("/busy")
            closed = await http.get("/closed")
        assert (busy.status_code, busy.json()) == (
            529,
            {"refused": "MLXThreadBusyError"},
        )
        assert closed.json() == {"refused": "MLXThreadClosedError"}
        assert [type(error) for error in seen] == [
            MLXThreadBusyError,
            MLXThreadClosedError,
        ]
        async with client(app) as http:  # after the shut-down
            late = await http.get("/where")
        assert late.json() == {"refused": "ShuttingDownError"}
        assert isinstance(seen[-1], MLXThreadClosedError)

    async def test_a_failed_start_up_is_a_broken_thread_with_its_cause(self) -> None:
        def broken_load() -> None:
            raise FileNotFoundError("no weights")

        seen: list[MLXPinnedError] = []
        app = starlette_app(
            startup={"model": broken_load},
            refusal=functools.partial(self.refusal, seen),
        )
        with pytest.raises(LifespanFailed):
            async with run_lifespan(app):
                pass  # pragma: no cover
        async with client(app) as http:
            response = await http.get("/where")
        assert response.json() == {"refused": "MLXThreadBrokenError"}
        assert isinstance(seen[0].__cause__, FileNotFoundError)
        assert "failed to start" in str(seen[0])

    async def test_other_errors_pass_through_untouched(self) -> None:
        async def fails(request: Request) -> JSONResponse:
            raise KeyError("not ours")

        seen: list[MLXPinnedError] = []
        app = Starlette(
            routes=[Route("/", fails)],
            middleware=[
                Middleware(
                    MLXThreadMiddleware, refusal=functools.partial(self.refusal, seen)
                )
            ],
        )
        async with run_lifespan(app), client(app) as http:
            with pytest.raises(KeyError, match="not ours"):
                await http.get("/")
        assert seen == []


class TestStartupJobs:
    """A start-up job may be an @on_mlx_thread function; never a coroutine."""

    @pytest.mark.slow
    async def test_a_decorated_loader_stores_its_result(self) -> None:
        thread = MLXThread()
        decorated = on_mlx_thread(thread=thread)(load_model)
        app = starlette_app(thread=thread, startup={"model": decorated})
        async with run_lifespan(app) as state, client(app) as http:
            response = await http.get("/where")
        # It stored a never-awaited coroutine before.
        assert state["model"]["loaded_on"] == thread.ident
        assert response.json()["loaded_on_thread"] is True
        assert response.json()["total"] == 12

    async def test_a_partial_of_a_decorated_loader_stores_its_result(self) -> None:
        thread = MLXThread()

        @on_mlx_thread(thread=thread)
        def load_scaled(scale: int) -> dict[str, Any]:
            return {"loaded_on": threading.get_ident(), "weights": mx.arange(4) * scale}

        startup = {"model": functools.partial(load_scaled, 3)}
        app = starlette_app(thread=thread, startup=startup)
        async with run_lifespan(app) as state, client(app) as http:
            response = await http.get("/where")
        assert state["model"]["loaded_on"] == thread.ident
        assert response.json()["total"] == 18

    @pytest.mark.slow
    @pytest.mark.parametrize("kind", ["async def", "lambda calling a decorated"])
    async def test_a_job_returning_a_coroutine_fails_the_start_up(
        self, kind: str
    ) -> None:
        thread = MLXThread()
        decorated = on_mlx_thread(thread=thread)(load_model)

        async def load_async() -> dict[str, Any]:
            return load_model()  # pragma: no cover - never awaited

        job = load_async if kind == "async def" else lambda: decorated()
        app = starlette_app(thread=thread, startup={"model": job})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(LifespanFailed, match=r"TypeError: .* pass a plain"):
                async with run_lifespan(app):
                    pass  # pragma: no cover
            gc.collect()  # a coroutine never awaited nor closed warns here
        assert [str(w.message) for w in caught] == []
        assert thread.closed


class TestFastAPI:
    async def test_fastapi_app(self) -> None:
        from fastapi import FastAPI

        api = FastAPI()
        api.add_middleware(MLXThreadMiddleware, startup={"model": load_model})

        @api.get("/where")
        async def fastapi_where(request: Request) -> dict[str, bool]:
            thread: MLXThread = request.state.mlx_thread
            ran_on = await thread.run(threading.get_ident)
            return {
                "on_thread": ran_on == thread.ident == request.state.model["loaded_on"]
            }

        @api.get("/busy")
        async def fastapi_busy() -> None:
            raise MLXThreadBusyError("full")

        async with run_lifespan(api), client(api) as http:
            assert (await http.get("/where")).json() == {"on_thread": True}
            assert_refused(await http.get("/busy"), 503, "full")


class TestBareASGI:
    async def test_app_without_lifespan_support(self) -> None:
        async def bare(scope: Any, receive: Any, send: Any) -> None:
            assert scope["type"] == "http"  # like many small apps: no lifespan
            thread: MLXThread = scope["state"]["mlx_thread"]
            ran_on = await thread.run(threading.get_ident)
            body = b"yes" if ran_on == thread.ident else b"no"
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})

        app = MLXThreadMiddleware(bare, startup={"model": load_model})
        async with run_lifespan(app) as state, client(app) as http:
            assert (await http.get("/")).text == "yes"
            assert state["model"]["loaded_on"] == state["mlx_thread"].ident

    async def test_bare_app_busy_mapping(self) -> None:
        async def bare(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                return
            raise MLXThreadBusyError("full")

        app = MLXThreadMiddleware(bare, retry_after=7)
        async with run_lifespan(app), client(app) as http:
            response = await http.get("/")
        assert_refused(response, 503, "full")
        assert response.headers["retry-after"] == "7"


async def lifespan_raises_and_stops(middleware: MLXThreadMiddleware, text: str) -> None:
    """The lifespan raises (``text`` in the error, grouped by anyio or not),
    and the middleware's thread is stopped."""
    with pytest.raises(BaseException) as info:  # noqa: PT011
        async with run_lifespan(middleware):
            pass
    assert text in repr(info.value)
    assert middleware.thread is not None
    assert middleware.thread.closed


class TestLifespanEdges:
    """An app whose lifespan misbehaves: the thread never outlives it."""

    async def test_an_app_raising_on_the_start_up_message_is_answered_for_loudly(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()  # an app whose start-up fails, or a bare app
            raise RuntimeError("no config file")

        # As a server goes on without lifespan (uvicorn's "auto"); it was
        # answered "complete" without a word before.
        async with run_lifespan(MLXThreadMiddleware(app)) as state:
            assert await state["mlx_thread"].run(lambda: 2) == 2
        assert "answering for it as for an app without lifespan" in caplog.text
        assert "no config file" in caplog.text

    async def test_a_bare_app_reading_first_is_still_served(self) -> None:
        async def bare(scope: Any, receive: Any, send: Any) -> None:
            await receive()  # reads its "request" before looking at the scope
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        app = MLXThreadMiddleware(bare)
        sent: list[Any] = []

        async def receive() -> Any:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        async with run_lifespan(app):  # its start-up answered for it
            await app({"type": "http", "path": "/", "state": {}}, receive, send)
        assert [m.get("status", m.get("body")) for m in sent] == [200, b"ok"]

    async def test_an_app_failing_while_serving_keeps_the_thread_until_shutdown(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                await receive()
                await send({"type": "lifespan.startup.complete"})
                raise RuntimeError("background task died")
            thread: MLXThread = scope["state"]["mlx_thread"]
            body = str(await thread.run(lambda: 42)).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})

        middleware = MLXThreadMiddleware(app)
        async with run_lifespan(middleware), client(middleware) as http:
            assert (await http.get("/")).text == "42"  # not "shutting down"
        assert "failed after its start-up" in caplog.text
        assert middleware.thread is not None
        assert middleware.thread.closed  # stopped at the server's shut-down

    async def test_an_app_that_reports_its_failed_start_up_is_not_waited_for(
        self,
    ) -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "bad"})

        middleware = MLXThreadMiddleware(app)
        to_app, inbox = anyio.create_memory_object_stream[Any](4)
        outbox, from_app = anyio.create_memory_object_stream[Any](4)
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        with anyio.fail_after(10):  # it waited for a shut-down never sent
            async with to_app, inbox, outbox, from_app:
                await to_app.send({"type": "lifespan.startup"})
                await middleware(scope, inbox.receive, outbox.send)
                assert (await from_app.receive())["type"] == "lifespan.startup.failed"
        assert middleware.thread is not None
        assert middleware.thread.closed

    @pytest.mark.slow
    async def test_a_cancelled_start_up_does_not_wait_for_the_job(self) -> None:
        release = threading.Event()
        middleware = MLXThreadMiddleware(
            Starlette(), startup={"model": lambda: release.wait(30)}
        )
        try:
            # A shielded join waited out the whole job (a model load).
            with anyio.fail_after(10), anyio.move_on_after(0.3):
                async with run_lifespan(middleware):
                    pass
            assert middleware.thread is not None
            assert middleware.thread.closed
        finally:
            release.set()

    async def test_an_app_that_returns_after_starting_still_stops_the_thread(
        self,
    ) -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "lifespan.startup.complete"})  # then returns

        with anyio.fail_after(10):  # no shutdown.complete came: a hang
            async with run_lifespan(MLXThreadMiddleware(app)) as state:
                thread: MLXThread = state["mlx_thread"]
                assert await thread.run(lambda: 1) == 1
        assert thread.closed  # shut-down answered for it, thread stopped

    async def test_an_app_failing_its_shutdown_stops_the_thread(self) -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            raise RuntimeError("shutdown hook failed")

        await lifespan_raises_and_stops(MLXThreadMiddleware(app), "shutdown hook")

    async def test_a_start_up_job_raising_a_base_exception_stops_the_thread(
        self,
    ) -> None:
        class Stop(BaseException):
            pass

        def job() -> None:
            raise Stop

        middleware = MLXThreadMiddleware(Starlette(), startup={"model": job})
        await lifespan_raises_and_stops(middleware, "Stop")


@on_mlx_thread
def loaded_here() -> dict[str, Any]:
    """A module-level load with no thread=: it follows the default thread."""
    return {"loaded_on": threading.get_ident(), "weights": mx.arange(4) * 2}


@on_mlx_thread
def ran_here(model: dict[str, Any]) -> dict[str, int]:
    return {"ran_on": threading.get_ident(), "total": int(model["weights"].sum())}


async def follow_the_default(request: Request) -> JSONResponse:
    thread: MLXThread = request.state.mlx_thread
    result = await ran_here(request.state.model)
    return JSONResponse(
        {**result, "thread": thread.ident, **request.state.model, "weights": None}
    )


class TestSeveralLifespans:
    """A lifespan per test (a TestClient each) in one process."""

    def test_module_level_functions_follow_each_lifespans_thread(self) -> None:
        app = Starlette(
            routes=[Route("/", follow_the_default)],
            middleware=[
                Middleware(MLXThreadMiddleware, startup={"model": loaded_here})
            ],
        )
        threads = []
        for _ in range(3):
            with TestClient(app) as http:
                response = http.get("/")
                assert response.status_code == 200
                answer = response.json()
                # Loaded and run on the MLX thread of this lifespan.
                assert answer["ran_on"] == answer["loaded_on"] == answer["thread"]
                assert answer["total"] == 12
                thread = current_default_mlx_thread()
                assert answer["thread"] == thread.ident
                threads.append(thread)
            assert thread.closed  # stopped with its lifespan
        assert len({id(thread) for thread in threads}) == 3  # a fresh one each

    def test_a_given_thread_serves_one_lifespan_and_says_so(self) -> None:
        thread = MLXThread(name="given")
        app = starlette_app(thread=thread)
        with TestClient(app) as http:
            assert http.get("/where").status_code == 200
        # It started, silently served 503 "shutting down", then hung at exit.
        with (
            pytest.raises(MLXThreadClosedError, match="serves one"),
            TestClient(app),
        ):
            pass  # pragma: no cover

    async def test_a_request_after_a_failed_start_up_is_not_told_shutting_down(
        self,
    ) -> None:
        def broken_load() -> None:
            raise FileNotFoundError("no weights")

        app = starlette_app(startup={"model": broken_load})
        with pytest.raises(LifespanFailed):
            async with run_lifespan(app):
                pass  # pragma: no cover
        async with client(app) as http:
            response = await http.get("/where")
        assert_refused(response, 503, "failed to start")

    async def test_overlapping_lifespans_share_the_default_until_the_last_ends(
        self,
    ) -> None:
        first, second = starlette_app(), starlette_app()
        async with run_lifespan(first) as one:
            async with run_lifespan(second) as two:
                assert one["mlx_thread"] is two["mlx_thread"]
            thread: MLXThread = one["mlx_thread"]
            assert not thread.closed  # the other lifespan still uses it
            async with client(first) as http:
                assert (await http.get("/where")).json()["ran_on_thread"] is True
        assert thread.closed


def test_websocket_refused_with_1013() -> None:
    async def socket(websocket: WebSocket) -> None:
        raise MLXThreadBusyError("queue full")

    app = Starlette(
        routes=[WebSocketRoute("/ws", socket)],
        middleware=[Middleware(MLXThreadMiddleware)],
    )
    with TestClient(app) as http, http.websocket_connect("/ws") as ws:
        # Closed before the accept, the server answered the handshake with an
        # HTTP 403, and the client never saw the documented 1013.
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_text()
    assert info.value.code == 1013
    assert "queue full" in info.value.reason


def test_websocket_close_reason_fits_a_close_frame() -> None:
    async def socket(websocket: WebSocket) -> None:
        raise MLXThreadBrokenError("the thread died: " + "why " * 100)

    app = Starlette(
        routes=[WebSocketRoute("/ws", socket)],
        middleware=[Middleware(MLXThreadMiddleware)],
    )
    with TestClient(app) as http, http.websocket_connect("/ws") as ws:
        # A longer reason makes websockets fail the close (a protocol error).
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_text()
    assert info.value.code == 1013
    assert info.value.reason.startswith("the thread died: why")
    assert len(info.value.reason.encode()) <= 123
