"""Mixins that make a ``with`` / ``async with`` block close what it opened.

Their methods run where the block is: the caller's thread or event loop (for
the stream iterators, the consumer's; for MLXThread, whoever owns it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import sys
    from types import TracebackType

    if sys.version_info >= (3, 11):
        from typing import Self
    else:  # pragma: no cover
        from typing_extensions import Self


class _Closable(Protocol):
    def close(self) -> None: ...


class _AsyncClosable(Protocol):
    async def aclose(self) -> None: ...


class Closing:
    """``with x:`` gives ``x`` and calls ``x.close()`` on the way out."""

    __slots__ = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self: _Closable,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClosing:
    """``async with x:`` gives ``x`` and awaits ``x.aclose()`` on the way out,
    as anyio's ``AsyncResource``."""

    __slots__ = ()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self: _AsyncClosable,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.aclose()
