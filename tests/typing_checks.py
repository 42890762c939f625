"""Type checks of the decorator, run by ``tests/test_typing.py`` through
``mypy --strict``; never imported by pytest.

Each ``assert_type`` fails the check if the decorator loses a signature.
The module also runs: nothing here starts a thread at import.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.types import Lifespan
from typing_extensions import assert_type

from mlx_pinned import MLXThread, mlx_lifespan, on_mlx_thread
from mlx_pinned.types import (
    AsyncStreamIterator,
    MLXFunction,
    MLXGeneratorFunction,
    MLXLifespan,
    SyncStreamIterator,
)

mlx_thread = MLXThread(name="typing")


@on_mlx_thread
def add(x: int, y: int = 0) -> int:
    return x + y


@on_mlx_thread(thread=mlx_thread, exclusive="model")
def count(n: int) -> Iterator[int]:
    yield from range(n)


@on_mlx_thread
def nothing() -> None:
    pass


class Kinds:
    @on_mlx_thread
    def method(self, x: int) -> str:
        return str(x)

    @on_mlx_thread
    @staticmethod
    def static(x: int) -> float:
        return float(x)

    @on_mlx_thread
    @classmethod
    def made(cls, x: int) -> bytes:
        return cls.__name__.encode() * x

    @on_mlx_thread(exclusive="model")
    def tokens(self, n: int) -> Iterator[int]:
        yield from range(n)

    @on_mlx_thread
    @staticmethod
    def static_tokens(n: int) -> Iterator[int]:
        yield from range(n)

    @on_mlx_thread
    @classmethod
    def class_tokens(cls, n: int) -> Iterator[str]:
        yield from [cls.__name__] * n


def close(coroutine: Coroutine[Any, Any, Any]) -> None:
    coroutine.close()  # never awaited: these checks are about types


def functions() -> None:
    assert_type(add.sync(1, 2), int)
    assert_type(add.sync(x=1), int)  # the first parameter keeps its name
    close(assert_type(add(1), Coroutine[Any, Any, int]))
    assert_type(nothing.sync(), None)
    assert_type(count(2), AsyncStreamIterator[int])
    assert_type(count.sync(2), SyncStreamIterator[int])
    plain: MLXFunction[[int, int], int] = add  # the exported names annotate it
    stream: MLXGeneratorFunction[[int], int] = count
    del plain, stream


def methods(kinds: Kinds) -> None:
    assert_type(kinds.method.sync(1), str)
    assert_type(Kinds.method.sync(kinds, 1), str)
    close(assert_type(kinds.method(1), Coroutine[Any, Any, str]))
    assert_type(kinds.tokens(2), AsyncStreamIterator[int])
    assert_type(Kinds.tokens.sync(kinds, 2), SyncStreamIterator[int])


def static_methods(kinds: Kinds) -> None:
    # Through an instance too: a static method gets no instance.
    assert_type(kinds.static.sync(1), float)
    assert_type(Kinds.static.sync(1), float)
    close(assert_type(kinds.static(1), Coroutine[Any, Any, float]))
    assert_type(kinds.static_tokens(2), AsyncStreamIterator[int])
    assert_type(Kinds.static_tokens.sync(2), SyncStreamIterator[int])


def class_methods(kinds: Kinds) -> None:
    # On its class too: a class method gets the class.
    assert_type(Kinds.made.sync(1), bytes)
    assert_type(kinds.made.sync(1), bytes)
    close(assert_type(Kinds.made(1), Coroutine[Any, Any, bytes]))
    assert_type(Kinds.class_tokens(2), AsyncStreamIterator[str])
    assert_type(kinds.class_tokens.sync(2), SyncStreamIterator[str])


def lifespans() -> None:
    # What Starlette's and FastAPI's lifespan= accept, called or not.
    called: Lifespan[Starlette] = mlx_lifespan(startup={"model": lambda: 1})
    uncalled: Lifespan[Starlette] = mlx_lifespan
    assert_type(mlx_lifespan(), MLXLifespan)
    del called, uncalled
