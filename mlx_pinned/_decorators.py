"""``@on_mlx_thread``: make a function, generator function or method run on an
MLXThread.

Decoration runs where the module is imported; calling a wrapper queues the
work from the caller's thread, and the wrapped body runs on the MLX thread.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Coroutine, Generator, Iterator
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

from ._default import current_default_mlx_thread
from ._exclusive import Exclusive
from ._executor import MLXThread

if TYPE_CHECKING:
    from ._async_streams import AsyncStreamIterator
    from ._sync_streams import SyncStreamIterator

P = ParamSpec("P")
P2 = ParamSpec("P2")
FP = ParamSpec("FP")  # a function's whole signature, beside P: all but the first
R = TypeVar("R")
S = TypeVar("S")
Y = TypeVar("Y")
S_contra = TypeVar("S_contra", contravariant=True)
R_co = TypeVar("R_co", covariant=True)


class _Pinned:
    __slots__ = ("__dict__", "__weakref__", "_fn", "_key", "_runner", "_thread")
    # Set by functools.update_wrapper, declared for type checkers.
    __name__: str
    __qualname__: str
    __wrapped__: Callable[..., Any]

    def __init__(
        self, fn: Callable[..., Any], thread: MLXThread | None, key: object
    ) -> None:
        self._fn = fn
        self._thread = thread
        self._key = key  # the exclusive key, or None
        # Made once when the thread is known; the default thread is looked
        # up at each call, since it is replaced once shut down.
        self._runner: MLXThread | Exclusive | None = (
            None if thread is None else _runner(thread, key)
        )
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def _target(self) -> MLXThread | Exclusive:
        runner = self._runner
        if runner is None:
            return _runner(current_default_mlx_thread(), self._key)
        return runner

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._fn!r}>"


class MLXFunction(_Pinned, Generic[P, R]):
    """A sync function that runs on an MLXThread when called.

    Calling it returns an awaitable (asyncio or trio); ``.sync(...)`` calls it
    blockingly from any thread, inline on the MLXThread itself. Cancelling
    the awaiting task releases it at once; see :meth:`MLXThread.run`.
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        return self._target().run(self._fn, *args, **kwargs)

    def sync(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function on the thread and block until it returns."""
        result: R = self._target()._run_blocking(self._fn, args, kwargs)
        return result

    @overload
    def __get__(
        self, obj: None, owner: type[Any] | None = None
    ) -> MLXFunction[P, R]: ...
    @overload
    def __get__(
        self: MLXFunction[Concatenate[S, P2], R], obj: S, owner: type[Any] | None = None
    ) -> MLXFunction[P2, R]: ...
    def __get__(self, obj: Any, owner: Any = None) -> Any:
        bound = _bind(self._fn, obj, owner)
        return self if bound is None else MLXFunction(bound, self._thread, self._key)


class MLXGeneratorFunction(_Pinned, Generic[P, Y]):
    """A generator function whose generator runs on an MLXThread.

    Calling it returns an async iterator (see :meth:`MLXThread.iterate`);
    ``.sync(...)`` returns a blocking iterator for plain threads.
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> AsyncStreamIterator[Y]:
        return self._target().iterate(self._fn, *args, **kwargs)

    def sync(self, *args: P.args, **kwargs: P.kwargs) -> SyncStreamIterator[Y]:
        """Iterate the generator from a plain thread, blocking per item."""
        return self._target().iterate_sync(self._fn, *args, **kwargs)

    @overload
    def __get__(
        self, obj: None, owner: type[Any] | None = None
    ) -> MLXGeneratorFunction[P, Y]: ...
    @overload
    def __get__(
        self: MLXGeneratorFunction[Concatenate[S, P2], Y],
        obj: S,
        owner: type[Any] | None = None,
    ) -> MLXGeneratorFunction[P2, Y]: ...
    def __get__(self, obj: Any, owner: Any = None) -> Any:
        bound = _bind(self._fn, obj, owner)
        if bound is None:
            return self
        return MLXGeneratorFunction(bound, self._thread, self._key)


class _Signatures(Protocol[FP, S_contra, P, R_co]):
    """A function seen two ways, for type checkers only: its whole signature
    ``FP``, and its first positional parameter ``S`` apart from the rest
    ``P``, which is what binding it as a method leaves."""

    @overload
    def __call__(self, *args: FP.args, **kwargs: FP.kwargs) -> R_co: ...
    @overload
    def __call__(
        self, first: S_contra, /, *args: P.args, **kwargs: P.kwargs
    ) -> R_co: ...


class MLXMethod(MLXFunction[FP, R], Generic[FP, S, P, R]):
    """An :class:`MLXFunction` of a function with a positional parameter, typed
    to bind as Python binds it when read off a class or an instance.

    What the decorator returns for such a function, so type checkers know
    the first parameter ``S``: a method (``S`` is the instance's type) is
    bound when read off an instance; a class method (``S`` is the class's
    type, ``type[...]``) whenever it is read; a static method (``S`` is
    neither) never. Calls and ``.sync`` take the whole signature ``FP``.
    """

    @overload  # a class method, read off its class or an instance
    def __get__(self, obj: object, owner: S) -> MLXFunction[P, R]: ...
    @overload
    def __get__(self, obj: None, owner: object = None) -> MLXFunction[FP, R]: ...
    @overload
    def __get__(self, obj: S, owner: object = None) -> MLXFunction[P, R]: ...
    @overload  # a static method, read off an instance
    def __get__(self, obj: object, owner: object = None) -> MLXFunction[FP, R]: ...
    def __get__(self, obj: Any, owner: Any = None) -> Any:
        bound = _bind(self._fn, obj, owner)
        return self if bound is None else MLXFunction(bound, self._thread, self._key)


class MLXGeneratorMethod(MLXGeneratorFunction[FP, Y], Generic[FP, S, P, Y]):
    """An :class:`MLXGeneratorFunction` of a generator function with a
    positional parameter; typed to bind as :class:`MLXMethod` is."""

    @overload  # a class method, read off its class or an instance
    def __get__(self, obj: object, owner: S) -> MLXGeneratorFunction[P, Y]: ...
    @overload
    def __get__(
        self, obj: None, owner: object = None
    ) -> MLXGeneratorFunction[FP, Y]: ...
    @overload
    def __get__(self, obj: S, owner: object = None) -> MLXGeneratorFunction[P, Y]: ...
    @overload  # a static method, read off an instance
    def __get__(
        self, obj: object, owner: object = None
    ) -> MLXGeneratorFunction[FP, Y]: ...
    def __get__(self, obj: Any, owner: Any = None) -> Any:
        bound = _bind(self._fn, obj, owner)
        if bound is None:
            return self
        return MLXGeneratorFunction(bound, self._thread, self._key)


def _runner(thread: MLXThread, key: object) -> MLXThread | Exclusive:
    return thread if key is None else thread.exclusive(key)


def _bind(fn: Any, obj: Any, owner: Any) -> Any:
    """``fn`` as an attribute of ``obj`` (or of the class ``owner``), bound by
    its own descriptor as Python binds it: a method to the instance (its name
    and docstring kept), a static method to nothing, a class method to the
    class. None when that is ``fn`` itself (a function read off its class)."""
    if obj is None and not isinstance(fn, (staticmethod, classmethod)):
        return None
    get = getattr(type(fn), "__get__", None)
    if get is None:  # a callable object: it gets the instance, as a method would
        return None if obj is None else functools.partial(fn, obj)
    return get(fn, obj, owner)


class _Decorator:
    __slots__ = ("_key", "_thread")

    def __init__(self, thread: MLXThread | None, key: object) -> None:
        self._thread = thread
        self._key = key

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, fn: _Signatures[FP, S, P, Generator[Y, Any, Any]], /
    ) -> MLXGeneratorMethod[FP, S, P, Y]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, fn: _Signatures[FP, S, P, Iterator[Y]], /
    ) -> MLXGeneratorMethod[FP, S, P, Y]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, fn: Callable[P, Generator[Y, Any, Any]], /
    ) -> MLXGeneratorFunction[P, Y]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, fn: Callable[P, Iterator[Y]], /
    ) -> MLXGeneratorFunction[P, Y]: ...
    @overload
    def __call__(self, fn: _Signatures[FP, S, P, R], /) -> MLXMethod[FP, S, P, R]: ...
    @overload
    def __call__(self, fn: Callable[P, R], /) -> MLXFunction[P, R]: ...
    def __call__(self, fn: Callable[..., Any], /) -> Any:
        return _wrap(fn, self._thread, self._key)


@overload
def on_mlx_thread(  # type: ignore[overload-overlap]
    fn: _Signatures[FP, S, P, Generator[Y, Any, Any]],
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> MLXGeneratorMethod[FP, S, P, Y]: ...
@overload
def on_mlx_thread(  # type: ignore[overload-overlap]
    fn: _Signatures[FP, S, P, Iterator[Y]],
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> MLXGeneratorMethod[FP, S, P, Y]: ...
@overload
def on_mlx_thread(  # type: ignore[overload-overlap]
    fn: Callable[P, Generator[Y, Any, Any]],
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> MLXGeneratorFunction[P, Y]: ...
@overload
def on_mlx_thread(  # type: ignore[overload-overlap]
    fn: Callable[P, Iterator[Y]],
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> MLXGeneratorFunction[P, Y]: ...
@overload
def on_mlx_thread(
    fn: _Signatures[FP, S, P, R],
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> MLXMethod[FP, S, P, R]: ...
@overload
def on_mlx_thread(
    fn: Callable[P, R],
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> MLXFunction[P, R]: ...
@overload
def on_mlx_thread(
    *, thread: MLXThread | None = None, exclusive: object = None
) -> _Decorator: ...
def on_mlx_thread(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    thread: MLXThread | None = None,
    exclusive: object = None,
) -> Any:
    """Make ``fn`` run on an MLXThread.

    A sync function becomes an async function; a generator function becomes
    an async iterator factory (items are produced on the thread). Both get a
    ``.sync`` for plain threads, and work on methods. Use bare, as
    ``@on_mlx_thread(thread=t, exclusive=key)``, or as
    ``on_mlx_thread(fn, thread=t, exclusive=key)``; without ``thread`` each
    call goes to :func:`current_default_mlx_thread`.

    Args:
        fn: the function or generator function.
        thread: the MLXThread to run on; the default thread if ``None``.
        exclusive: an exclusive key (a name, or the model object): calls
            that share it never overlap on the thread, a generator holding it
            from its first item until it ends or is closed. See
            :meth:`MLXThread.exclusive`. ``None``: no key.

    Raises:
        TypeError: ``fn`` is a coroutine or async generator function: it would
            run on an event loop, not on the MLX thread.
    """
    if fn is None:
        return _Decorator(thread, exclusive)
    return _wrap(fn, thread, exclusive)


def _context_manager_factory_code() -> object:
    def body() -> Iterator[None]:
        yield

    return contextlib.contextmanager(body).__code__  # the helper every one shares


_CONTEXT_MANAGER_FACTORY = _context_manager_factory_code()


def _wrap(fn: Callable[..., Any], thread: MLXThread | None, key: object) -> Any:
    target = inspect.unwrap(fn)
    if inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(
            f"@on_mlx_thread needs a plain function or generator function, and"
            f" {fn.__qualname__!r} is async: make it a def, since it runs on the"
            " MLX thread, not on an event loop."
        )
    if _is_context_manager_factory(fn):
        # Unwrapped, it is a generator function; but a stream would call the
        # factory and try to iterate its context manager, and as a plain
        # function the with-block (setup and teardown) would run on the caller.
        raise TypeError(
            f"@on_mlx_thread cannot run the with-block of {fn.__qualname__!r} "
            "(a @contextmanager) on the MLX thread: decorate the functions "
            "that its setup and teardown call instead."
        )
    if not callable(fn) and not isinstance(fn, classmethod):
        raise TypeError(f"@on_mlx_thread needs a function, not {fn!r}")
    # The Method classes bind as their bases do; only their typing differs.
    if inspect.isgeneratorfunction(target):
        return MLXGeneratorMethod(fn, thread, key)
    return MLXMethod(fn, thread, key)


def _is_context_manager_factory(fn: object) -> bool:
    """Whether ``fn``, or a wrapper on the way to what it wraps, is made by
    ``contextlib.contextmanager`` (the chain is finite: unwrapped before)."""
    while fn is not None:
        if getattr(fn, "__code__", None) is _CONTEXT_MANAGER_FACTORY:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False
