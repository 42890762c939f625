from __future__ import annotations

from concurrent.futures import BrokenExecutor

import pytest

import mlx_pinned
import mlx_pinned.types
from mlx_pinned import (
    BlockingCallWarning,
    MLXPinnedError,
    MLXPinnedWarning,
    MLXThreadBrokenError,
    MLXThreadBusyError,
    MLXThreadClosedError,
    MLXThreadDeadlockError,
    SharedModelWarning,
    StreamAffinityError,
)


def isort_order(name: str) -> tuple[int, str]:
    """Where ruff's ``__all__`` sort (RUF022) puts a name: constants, then
    classes, then the rest, each group in order."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_all_is_sorted_and_matches_the_public_names() -> None:
    public = {
        name
        for name in vars(mlx_pinned)
        if not name.startswith("_")
        and name not in {"annotations"}
        and not isinstance(getattr(mlx_pinned, name), type(mlx_pinned))
    }
    assert sorted(mlx_pinned.__all__, key=isort_order) == mlx_pinned.__all__
    assert set(mlx_pinned.__all__) - {"__version__"} == public


def test_the_types_module_lists_what_it_exports() -> None:
    public = {name for name in vars(mlx_pinned.types) if not name.startswith("_")}
    assert sorted(mlx_pinned.types.__all__) == mlx_pinned.types.__all__
    assert set(mlx_pinned.types.__all__) == public - {"annotations"}
    # Types to annotate with are not concepts: none is at the top level too.
    assert not set(mlx_pinned.types.__all__) & set(mlx_pinned.__all__)


def test_public_objects_claim_the_package() -> None:
    for name in mlx_pinned.__all__:
        if name != "__version__":
            assert getattr(mlx_pinned, name).__module__.startswith("mlx_pinned")


def test_error_tree() -> None:
    for error in (
        MLXThreadBrokenError,
        MLXThreadBusyError,
        MLXThreadClosedError,
        MLXThreadDeadlockError,
        StreamAffinityError,
    ):
        assert issubclass(error, MLXPinnedError)
    # Misuse and dead-resource errors are RuntimeErrors, as anyio's portal raises.
    for error in (
        MLXThreadBrokenError,
        MLXThreadClosedError,
        MLXThreadDeadlockError,
        StreamAffinityError,
    ):
        assert issubclass(error, RuntimeError)
    assert not issubclass(MLXThreadBusyError, RuntimeError)
    assert not issubclass(MLXThreadClosedError, MLXThreadBrokenError)


def test_a_broken_thread_is_a_broken_executor() -> None:
    # Code written against the standard library's executors catches it.
    assert issubclass(MLXThreadBrokenError, BrokenExecutor)
    assert MLXThreadBrokenError.__mro__.index(
        MLXPinnedError
    ) < MLXThreadBrokenError.__mro__.index(BrokenExecutor)
    with pytest.raises(BrokenExecutor, match="died"):
        raise MLXThreadBrokenError("the thread died")


def test_warning_tree() -> None:
    # UserWarning: shown once per place by default, filterable by class.
    assert issubclass(MLXPinnedWarning, UserWarning)
    assert issubclass(BlockingCallWarning, MLXPinnedWarning)
    assert issubclass(SharedModelWarning, MLXPinnedWarning)


def test_version() -> None:
    from importlib.metadata import version

    assert mlx_pinned.__version__ == version("mlx-pinned")
