"""mlx_lifespan: an MLXThread started and stopped with an app's lifespan.

Its code runs on the event loop; the start-up jobs run on the MLX thread.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from types import TracebackType

from ._decorators import MLXFunction
from ._default import hold_default_mlx_thread, release_default_mlx_thread
from ._exceptions import MLXThreadClosedError
from ._executor import MLXThread

__all__ = ["MLXLifespan", "mlx_lifespan"]

logger = logging.getLogger("mlx_pinned.lifespan")

StartupJobs = Mapping[str, Callable[[], object]]


def mlx_lifespan(
    app: object = None,
    /,
    *,
    thread: MLXThread | None = None,
    startup: StartupJobs | None = None,
    state_key: str = "mlx_thread",
) -> MLXLifespan:
    """An MLX thread for one lifespan of an app, with its start-up jobs.

    Give it to Starlette or FastAPI as ``lifespan=mlx_lifespan(startup=...)``
    (or ``lifespan=mlx_lifespan`` without options), or enter it yourself:
    ``async with mlx_lifespan(startup=...) as state``. On entry the thread
    starts and each ``startup`` callable runs on it, in order (load the model
    here); the state it yields holds the thread under ``state_key`` and each
    job's result under the job's name, which Starlette puts in
    ``request.state`` (bare ASGI: ``scope["state"]``). On exit the thread
    shuts down (``aclose()``: queued jobs run, open streams close on it).

    A start-up job may be a plain function, a ``functools.partial``, or an
    ``@on_mlx_thread`` function or a partial of one (called through its
    ``.sync`` from the thread). One that raises fails the entry, the thread
    stopped; one that returns an awaitable fails it with a ``TypeError`` (the
    coroutine is closed, never run on the event loop). Cancelled (the entry
    or the block), the thread is shut down without waiting: a model load
    still running is not waited out, queued jobs end cancelled.

    Args:
        app: Ignored: the app Starlette passes to its ``lifespan``.
        thread: The thread, for one lifespan (a thread that was shut down
            cannot start again). ``None``: the process-wide default,
            :func:`~mlx_pinned.current_default_mlx_thread`, the one
            ``@on_mlx_thread`` without ``thread=`` calls, shut down once no
            other lifespan holds it; the next lifespan gets a fresh one.
        startup: Name -> callable with no arguments, run on the thread at
            entry.
        state_key: The state key of the thread.

    Returns:
        An async context manager yielding the state; called with an app (as
        Starlette calls ``lifespan``), a fresh one with the same options.
    """
    return MLXLifespan(thread=thread, startup=startup, state_key=state_key)


class MLXLifespan:
    """One lifespan of an MLX thread: what :func:`mlx_lifespan` returns.

    Entered once; calling it (Starlette's ``lifespan(app)``) gives a fresh
    one with the same options, so an app can run one lifespan after another.

    Attributes:
        thread: The thread of this lifespan once entered (the given one, or
            the default it holds); ``None`` before.
        state: What entry yields: the thread and the start-up results.
    """

    def __init__(
        self,
        *,
        thread: MLXThread | None = None,
        startup: StartupJobs | None = None,
        state_key: str = "mlx_thread",
    ) -> None:
        self._given_thread = thread
        self.thread: MLXThread | None = thread
        self._startup = dict(startup or {})
        self.state_key = state_key
        self.state: dict[str, object] = {}
        # The thread this lifespan stops at its end, until it does.
        self._stops: MLXThread | None = None

    def __call__(self, app: object = None) -> MLXLifespan:
        return MLXLifespan(
            thread=self._given_thread, startup=self._startup, state_key=self.state_key
        )

    async def __aenter__(self) -> dict[str, object]:
        try:
            return await self.start()
        except Exception:
            await self.aclose()
            raise
        except BaseException:  # cancelled, SystemExit: no thread left behind
            self.abandon()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or isinstance(exc, Exception):
            await self.aclose()
        else:
            self.abandon()

    async def start(self) -> dict[str, object]:
        """Start the thread and run the start-up jobs on it: the state.

        What entry does, except that on a failure the thread is left for
        :meth:`aclose` (or :meth:`abandon`) to stop.
        """
        thread = self._given_thread
        if thread is None:
            thread = self.thread = hold_default_mlx_thread()
        elif thread.closed:
            raise MLXThreadClosedError(
                f"MLX thread {thread.name!r} was shut down by an earlier lifespan,"
                " and a thread given to a lifespan serves one: for a lifespan"
                " per test, pass no thread= (the lifespan and @on_mlx_thread then"
                " share the default thread, fresh for each lifespan), or create"
                " the thread with the app."
            )
        self._stops = thread
        thread.start()
        state: dict[str, object] = {self.state_key: thread}
        for name, load in self._startup.items():
            logger.info("running start-up job %r on the MLX thread", name)
            state[name] = _result(name, await thread.run(_blocking(load)))
        self.state = state
        return dict(state)

    async def aclose(self) -> None:
        """Shut the thread down and wait for it (once; later calls return)."""
        thread = self._let_go()
        if thread is not None:
            await thread.aclose()

    def abandon(self) -> None:
        """Shut the thread down without waiting (a start-up job may still
        run, and a model load is not waited out); queued jobs end."""
        thread = self._let_go()
        if thread is not None:
            thread.shutdown(wait=False, cancel_futures=True)

    def _let_go(self) -> MLXThread | None:
        """The thread to shut down as the lifespan ends, once: the given one,
        or the default once no other lifespan holds it (None: leave it up)."""
        thread, self._stops = self._stops, None
        if thread is None or thread is self._given_thread:
            return thread
        return thread if release_default_mlx_thread(thread) else None


def _blocking(job: Callable[[], object]) -> Callable[[], object]:
    """``job``, or the ``.sync`` of an ``@on_mlx_thread`` function (also under
    ``functools.partial``): called plain, that one only returns a coroutine."""
    if isinstance(job, MLXFunction):
        return job.sync
    if isinstance(job, functools.partial) and isinstance(job.func, MLXFunction):
        return functools.partial(job.func.sync, *job.args, **job.keywords)
    return job


def _result(name: str, result: object) -> object:
    """A start-up job's result, refused if it is awaitable: awaited here, an
    ``async def`` body would do its MLX work on the event loop's thread."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never started: nothing to undo, no warning
        raise TypeError(
            f"Start-up job {name!r} returned {type(result).__name__} instead of a "
            "result: pass a plain function, an @on_mlx_thread function or a "
            "functools.partial of one, not an async function or a lambda that "
            "calls one."
        )
    return result
