from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import anyio
import mlx.core as mx
import pytest

from mlx_pinned import (
    BlockingCallWarning,
    MLXThread,
    current_default_mlx_thread,
    on_mlx_thread,
)

WAIT = 10.0


@pytest.fixture
def thread() -> Iterator[MLXThread]:
    with MLXThread(name="decorated") as t:
        yield t


def test_function_becomes_async_and_runs_on_the_thread(thread: MLXThread) -> None:
    @on_mlx_thread(thread=thread)
    def scaled(x: int, *, by: int = 2) -> tuple[int, int]:
        return threading.get_ident(), x * by

    async def main() -> tuple[int, int]:
        return await scaled(21)

    assert anyio.run(main) == (thread.ident, 42)
    assert anyio.run(main, backend="trio") == (thread.ident, 42)
    assert scaled.sync(5, by=3) == (thread.ident, 15)
    assert scaled.__name__ == "scaled"
    assert scaled.__wrapped__.__name__ == "scaled"


def test_sync_on_an_event_loop_warns_at_the_call(thread: MLXThread) -> None:
    @on_mlx_thread(thread=thread)
    def where() -> int:
        return threading.get_ident()

    @on_mlx_thread(thread=thread)
    def count(n: int) -> Iterator[int]:
        yield from range(n)

    async def main() -> None:
        with pytest.warns(BlockingCallWarning, match="asyncio event loop") as info:
            assert where.sync() == thread.ident
        assert info[0].filename == __file__
        with pytest.warns(BlockingCallWarning) as info:
            assert list(count.sync(2)) == [0, 1]
        assert info[0].filename == __file__
        assert await where() == thread.ident  # what to do instead: no warning

    anyio.run(main)


def test_generator_function_becomes_async_iterator(thread: MLXThread) -> None:
    @on_mlx_thread(thread=thread)
    def tokens(n: int) -> Iterator[tuple[int, int]]:
        for i in range(n):
            yield threading.get_ident(), (mx.array(i) * 10).tolist()  # type: ignore[misc]

    async def main() -> list[tuple[int, int]]:
        return [item async for item in tokens(3)]

    expected = [(thread.ident, 0), (thread.ident, 10), (thread.ident, 20)]
    assert anyio.run(main) == expected
    assert anyio.run(main, backend="trio") == expected
    assert list(tokens.sync(3)) == expected


class Model:
    def __init__(self, scale: int) -> None:
        self.scale = scale

    @on_mlx_thread
    def forward(self, x: int) -> tuple[int, int]:
        return threading.get_ident(), x * self.scale

    @on_mlx_thread
    def stream(self, n: int) -> Iterator[int]:
        for i in range(n):
            yield i * self.scale


def test_methods_bind_self_and_sync_works_on_bound_methods() -> None:
    model = Model(3)
    default = current_default_mlx_thread()

    async def main() -> tuple[tuple[int, int], list[int]]:
        return await model.forward(2), [i async for i in model.stream(3)]

    assert anyio.run(main) == ((default.ident, 6), [0, 3, 6])
    assert model.forward.sync(4) == (default.ident, 12)
    assert list(model.stream.sync(2)) == [0, 3]
    assert Model.forward.sync(model, 1) == (default.ident, 3)  # unbound, explicit


class Kinds:
    """Each kind of method, with the decorator above its descriptor."""

    @on_mlx_thread
    def method(self, x: int) -> tuple[str, int]:
        """A method's docstring."""
        return type(self).__name__, x

    @on_mlx_thread
    @staticmethod
    def static(x: int) -> int:
        return x + 1

    @on_mlx_thread
    @classmethod
    def made(cls, x: int) -> tuple[str, int]:
        return cls.__name__, x

    @on_mlx_thread
    @staticmethod
    def numbers(n: int) -> Iterator[int]:
        yield from range(n)


class Sub(Kinds):
    pass


def test_each_kind_of_method_binds_as_python_binds_it() -> None:
    kinds = Kinds()
    # A static method gets no instance, through the instance or the class.
    assert kinds.static.sync(1) == Kinds.static.sync(1) == 2
    assert list(kinds.numbers.sync(3)) == [0, 1, 2]
    # A class method gets the class it was read from.
    assert kinds.made.sync(5) == Kinds.made.sync(5) == ("Kinds", 5)
    assert Sub.made.sync(6) == Sub().made.sync(6) == ("Sub", 6)
    assert anyio.run(lambda: Sub().made(7)) == ("Sub", 7)
    # A bound method keeps its name and docstring, and wraps the bound method.
    bound = kinds.method
    assert bound.sync(3) == ("Kinds", 3)
    assert (bound.__name__, bound.__doc__) == ("method", "A method's docstring.")
    assert bound.__wrapped__.__self__ is kinds


def test_default_thread_chosen_at_call_time() -> None:
    @on_mlx_thread
    def where() -> threading.Thread:
        return threading.current_thread()

    first = current_default_mlx_thread()
    first_thread = where.sync()
    assert first_thread is first.run_sync(threading.current_thread)
    first.shutdown()
    second = current_default_mlx_thread()
    # Thread objects, not idents: the OS may reuse an exited thread's ident.
    assert where.sync() is second.run_sync(threading.current_thread)
    assert second is not first
    assert not first_thread.is_alive()


def test_async_functions_are_refused_at_decoration() -> None:
    with pytest.raises(TypeError, match="is async"):

        @on_mlx_thread
        async def coroutine() -> None:
            pass

    with pytest.raises(TypeError, match="is async"):

        @on_mlx_thread()
        async def agen() -> Iterator[int]:  # type: ignore[misc]
            yield 1


def test_context_manager_factories_are_refused_at_decoration() -> None:
    @contextlib.contextmanager
    def session() -> Iterator[int]:
        yield 1

    class Holder:
        opened = staticmethod(session)

    # Unwrapped, a @contextmanager is a generator function: it was taken for
    # one, and iterating failed later on the thread with "not iterable".
    for fn in (session, Holder.__dict__["opened"]):
        with pytest.raises(TypeError, match=r"with-block of .*contextmanager"):
            on_mlx_thread(fn)


def test_generator_wrapped_by_a_plain_function_is_still_a_stream(
    thread: MLXThread,
) -> None:
    def gen(n: int) -> Iterator[int]:
        yield from range(n)

    @functools.wraps(gen)
    def logged(n: int) -> Iterator[int]:
        return gen(n)  # a plain function returning the generator

    assert list(on_mlx_thread(thread=thread)(logged).sync(3)) == [0, 1, 2]


def test_not_callable_refused() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        on_mlx_thread(42)  # type: ignore[call-overload]


def test_inline_call_from_the_thread(thread: MLXThread) -> None:
    @on_mlx_thread(thread=thread)
    def inner() -> int:
        return threading.get_ident()

    @on_mlx_thread(thread=thread)
    def outer() -> int:
        return inner.sync()  # on the thread: inline, not a deadlock

    assert thread.submit(outer.sync).result(WAIT) == thread.ident


def test_cancelled_decorated_call_releases_caller(thread: MLXThread) -> None:
    gate = threading.Event()

    @on_mlx_thread(thread=thread)
    def slow() -> None:
        gate.wait(WAIT)

    async def main() -> bool:
        with anyio.move_on_after(0.05) as scope:
            await slow()
        return scope.cancelled_caught

    assert anyio.run(main) is True
    gate.set()


def test_signatures_are_kept_for_type_checkers() -> None:
    # Checked by mypy --strict over the tests (see README): each assert_type
    # fails the type check if the decorator loses the signature.
    from collections.abc import Coroutine
    from typing import Any

    from typing_extensions import assert_type

    from mlx_pinned.types import AsyncStreamIterator, SyncStreamIterator

    @on_mlx_thread
    def add(x: int, y: int) -> int:
        return x + y

    @on_mlx_thread
    def count(n: int) -> Iterator[int]:
        yield from range(n)

    model = Model(2)
    assert_type(add.sync(1, 2), int)
    assert_type(count.sync(2), SyncStreamIterator[int])
    assert_type(count(2), AsyncStreamIterator[int])
    assert_type(model.forward.sync(1), tuple[int, int])
    coroutine = assert_type(model.forward(1), Coroutine[Any, Any, tuple[int, int]])
    coroutine.close()  # not awaited: this test is about types
    assert add.sync(1, 2) == 3
    assert list(count.sync(2)) == [0, 1]


class TestExclusive:
    def test_calls_with_one_key_never_overlap(self, thread: MLXThread) -> None:
        log: list[str] = []

        @on_mlx_thread(thread=thread, exclusive="model")
        def generate(name: str, n: int) -> Iterator[int]:
            try:
                for i in range(n):
                    log.append(f"{name}:{i}")
                    yield i
            finally:
                log.append(f"{name}:end")

        @on_mlx_thread(thread=thread, exclusive="model")
        def keyed(what: str) -> None:
            log.append(what)

        @on_mlx_thread(thread=thread)
        def plain(what: str) -> None:
            log.append(what)

        stream = generate.sync("gen", 6)
        assert next(stream) == 0
        waiting = threading.Thread(target=keyed.sync, args=("keyed",))
        waiting.start()
        plain.sync("plain")  # runs while the keyed stream is open
        assert list(stream) == [1, 2, 3, 4, 5]
        waiting.join(WAIT)
        assert log.index("plain") < log.index("gen:5")
        assert log.index("gen:end") < log.index("keyed")

    def test_the_call_form_and_the_default_thread(self) -> None:
        log: list[str] = []

        def gen(n: int) -> Iterator[int]:
            try:
                yield from range(n)
            finally:
                log.append("gen:end")

        keyed_gen = on_mlx_thread(gen, exclusive="default-key")
        keyed_append = on_mlx_thread(log.append, exclusive="default-key")
        stream = keyed_gen.sync(3)
        assert next(stream) == 0
        default = current_default_mlx_thread()
        future = default.submit(lambda: None)  # unkeyed: not held up
        future.result(WAIT)

        async def main() -> None:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(keyed_append, "keyed")
                with anyio.fail_after(WAIT):  # it waits for the key
                    while not default.statistics().waiting_for_key:  # noqa: ASYNC110
                        await anyio.sleep(0.001)
                assert log == []
                assert await anyio.to_thread.run_sync(list, stream) == [1, 2]

        anyio.run(main)
        assert log == ["gen:end", "keyed"]

    def test_a_keyed_call_of_the_same_key_inside_runs_inline(
        self, thread: MLXThread
    ) -> None:
        @on_mlx_thread(thread=thread, exclusive="model")
        def inner() -> int:
            return threading.get_ident()

        @on_mlx_thread(thread=thread, exclusive="model")
        def outer() -> tuple[int, int]:
            return inner.sync(), thread.run_sync(threading.get_ident)

        @on_mlx_thread(thread=thread, exclusive="model")
        def stream() -> Iterator[int]:
            yield inner.sync()

        assert outer.sync() == (thread.ident, thread.ident)
        assert list(stream.sync()) == [thread.ident]

    def test_methods_keep_their_key(self, thread: MLXThread) -> None:
        log: list[str] = []

        class Generator:
            @on_mlx_thread(thread=thread, exclusive="model")
            def tokens(self, n: int) -> Iterator[int]:
                try:
                    yield from range(n)
                finally:
                    log.append("tokens:end")

            @on_mlx_thread(thread=thread, exclusive="model")
            def step(self) -> None:
                log.append("step")

        generator = Generator()
        stream = generator.tokens.sync(2)
        assert next(stream) == 0
        thread.submit(lambda: None).result(WAIT)  # unkeyed: not held up
        keyed = threading.Thread(target=generator.step.sync)
        keyed.start()
        assert list(stream) == [1]
        keyed.join(WAIT)
        assert log == ["tokens:end", "step"]

    def test_keyed_signatures_are_kept_for_type_checkers(
        self, thread: MLXThread
    ) -> None:
        from typing_extensions import assert_type

        from mlx_pinned.types import SyncStreamIterator

        def count(n: int) -> Iterator[int]:
            yield from range(n)

        def add(x: int, y: int) -> int:
            return x + y

        keyed_count = on_mlx_thread(count, thread=thread, exclusive="k")
        keyed_add = on_mlx_thread(add, exclusive="k")
        assert_type(keyed_count.sync(2), SyncStreamIterator[int])
        assert_type(keyed_add.sync(1, 2), int)
        assert keyed_add.sync(1, 2) == 3
        assert list(keyed_count.sync(2)) == [0, 1]
