"""One error tree for mlx-pinned, rooted at :class:`MLXPinnedError`, and its
warnings, rooted at :class:`MLXPinnedWarning`.

"Closed" means your own code shut the thread down; "broken" means it died under
you. Errors that signal misuse or a dead resource also subclass ``RuntimeError``
so code written against anyio's blocking portal keeps working.
"""

from __future__ import annotations

from concurrent.futures import BrokenExecutor

__all__ = [
    "BlockingCallWarning",
    "MLXPinnedError",
    "MLXPinnedWarning",
    "MLXThreadBrokenError",
    "MLXThreadBusyError",
    "MLXThreadClosedError",
    "MLXThreadDeadlockError",
    "SharedModelWarning",
    "ShuttingDownError",
    "StreamAffinityError",
]


class MLXPinnedError(Exception):
    """Base class of every error raised by mlx-pinned itself."""


class MLXThreadClosedError(MLXPinnedError, RuntimeError):
    """The :class:`~mlx_pinned.MLXThread` was shut down by your code.

    Raised by ``submit``/``run``/``iterate`` after ``shutdown()``, and to the
    consumer of a stream that was still open when the thread shut down.
    """


class ShuttingDownError(MLXThreadClosedError):
    """The app's lifespan is shutting down: new requests are refused while
    those in flight finish, then the thread shuts down.

    What :class:`~mlx_pinned.middleware.MLXThreadMiddleware` hands its
    ``refusal`` for a request that arrives in the shut-down: send new
    requests to another server.
    """


class MLXThreadBrokenError(MLXPinnedError, BrokenExecutor):
    """The :class:`~mlx_pinned.MLXThread` died: its set-up or initializer raised,
    or the process forked and the thread does not exist in the child.

    A ``concurrent.futures.BrokenExecutor`` (so a ``RuntimeError``), as the
    standard library's executors raise when they died. The original error,
    when there is one, is the ``__cause__``.
    """


class MLXThreadBusyError(MLXPinnedError):
    """The thread's queue already holds ``max_pending`` jobs: retry later.

    Raised at once by ``submit``/``run``/``iterate``; nothing was queued.
    """


class MLXThreadDeadlockError(MLXPinnedError, RuntimeError):
    """A call on the MLX thread would wait for work that only that thread can
    run, so it would never return: raised at once instead.

    For example, a job waiting on the future of another job of its own
    thread, or a job calling work inline whose exclusive key another open
    stream holds. The message says what to do instead.
    """


class StreamAffinityError(MLXPinnedError, RuntimeError):
    """A job touched an MLX array or stream that belongs to another thread.

    MLX streams are thread-local: a lazy array can only be evaluated on the
    thread that built it. The message names the job and, where it can, the
    argument at fault. The MLX error is the ``__cause__``.
    """


class MLXPinnedWarning(UserWarning):
    """Base class of every warning mlx-pinned gives.

    Turn them into errors in tests:
    ``warnings.simplefilter("error", MLXPinnedWarning)``, or pytest's
    ``filterwarnings = ["error::mlx_pinned.MLXPinnedWarning"]``.
    """


class BlockingCallWarning(MLXPinnedWarning):
    """A blocking call (``run_sync``, a decorated function's ``.sync``, or the
    iteration of a ``.sync`` stream) was made on a thread that runs an event
    loop (asyncio or trio): it holds the whole loop until the MLX thread
    answers. Await the call instead.
    """


class SharedModelWarning(MLXPinnedWarning):
    """Two streams open at once on one MLX thread were given the same
    ``mlx.nn.Module`` (as an argument, or in a tuple or list argument) and
    share no exclusive key: their items interleave, and a model that keeps
    request state on itself then gives wrong answers. Give both the same
    ``exclusive=`` key (the model itself will do).

    Raised on the MLX thread when the second stream starts, once per pair of
    functions; made an error, it ends that stream, whose consumer gets it.
    """
