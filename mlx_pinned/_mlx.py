"""Everything the executor knows about MLX, in one place.

The threading core in ``_executor`` calls these functions on its worker thread:
stream set-up and teardown, evaluation of results so no lazy array leaves the
thread, and translation of MLX's "There is no Stream" errors.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import mlx.core as mx

from ._exceptions import StreamAffinityError

# Modules whose plain (not thread-local) ``generation_stream`` global we point at
# the worker's stream: mlx-vlm 0.4.x and older mlx-lm create it with
# ``mx.new_stream`` at import time, on whichever thread imported them.
_STREAM_GLOBAL = "generation_stream"
_STREAM_MODULE_PREFIXES = ("mlx_lm", "mlx_vlm")
_STREAM_ERROR = "There is no Stream"
# The stream index in MLX's error ("Stream(cpu, 3)") and in a stream's repr
# ("Stream(Device(cpu, 0), 3)"); mx.Stream does not expose it.
_STREAM_INDEX = re.compile(r"Stream\((?:\w+|Device\(\w+, \d+\)), (\d+)\)")
SCALARS = (type(None), bool, int, float, str, bytes)


# Process-wide owners of the plain ``generation_stream`` globals: one global can
# point at one thread's stream only, so the first MLXThread that finds it owns
# it until it closes; then the original is restored and another may take it.
_owners: dict[str, tuple[ThreadStream, Any]] = {}  # module -> (owner, original)
_owners_lock = threading.Lock()
_owners_version = 0  # bumped on each release, so other threads rescan
# The MLX threads whose streams are alive, by stream index (global in MLX), to
# name the thread that owns an array in an affinity error.
_stream_threads: dict[int, str] = {}


class ThreadStream:
    """The worker thread's own stream and the module globals it adopted."""

    def __init__(self, device: Any = None, thread_name: str = "") -> None:
        self.device = mx.default_device() if device is None else device
        self.stream = mx.new_stream(self.device)
        self.thread_name = thread_name
        self._index = _stream_index(repr(self.stream))
        _stream_threads[self._index] = thread_name
        self.thread_ident = threading.get_ident()
        mx.set_default_stream(self.stream)
        self._seen = (-1, -1)
        self.adopt_module_streams()

    def adopt_module_streams(self) -> None:
        """Point unowned plain ``generation_stream`` globals at this stream.

        Cheap to call before every job: it rescans only when ``sys.modules``
        grew or another thread released a global.
        """
        seen = (len(sys.modules), _owners_version)
        if seen == self._seen:
            return
        self._seen = seen
        with _owners_lock:
            for name, module in list(sys.modules.items()):
                if not name.startswith(_STREAM_MODULE_PREFIXES) or name in _owners:
                    continue
                current = getattr(module, _STREAM_GLOBAL, None)
                # Thread-local streams (mlx-vlm >= 0.5, mlx-lm >= 0.31.3) work
                # on every thread as they are.
                if type(current) is mx.Stream:
                    _owners[name] = (self, current)
                    setattr(module, _STREAM_GLOBAL, self.stream)

    def close(self) -> None:
        """Restore the globals this thread owns, then drop its streams.

        ``mx.clear_streams()`` must be the thread's last MLX call: a thread that
        used MLX and exits without it can abort the process at exit.
        """
        global _owners_version
        with _owners_lock:
            for name, (owner, original) in list(_owners.items()):
                if owner is not self:
                    continue
                del _owners[name]
                module = sys.modules.get(name)
                if getattr(module, _STREAM_GLOBAL, None) is self.stream:
                    setattr(module, _STREAM_GLOBAL, original)
            _owners_version += 1
        _stream_threads.pop(self._index, None)
        mx.clear_streams()


def globals_owned_elsewhere() -> list[str]:
    """``generation_stream`` globals that another live MLXThread owns."""
    here = threading.get_ident()
    with _owners_lock:
        return [
            f"{name}.{_STREAM_GLOBAL} (owned by MLX thread {owner.thread_name!r})"
            for name, (owner, _) in _owners.items()
            if owner.thread_ident != here
        ]


def evaluate(value: object) -> None:
    """Evaluate every MLX array in ``value`` on the calling thread.

    Walks lists, tuples, dicts (``nn.Module`` is one, so a model is evaluated
    whole, private attributes included) and dataclasses; other objects pass.
    """
    arrays = _arrays(value)
    if arrays:
        mx.eval(arrays)


def _arrays(value: object) -> list[object]:
    arrays: list[object] = []
    _collect(value, arrays)
    return arrays


def _collect(value: object, arrays: list[object]) -> None:
    if isinstance(value, SCALARS):
        return
    if isinstance(value, mx.array):
        arrays.append(value)
    elif isinstance(value, Mapping):
        # nn.Module is a dict of its children: mx.eval(module) reaches lazy
        # private members (RoPE tables) that module.parameters() would skip.
        for item in value.values():
            _collect(item, arrays)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, arrays)
    else:
        for name in _field_names(type(value)):
            _collect(getattr(value, name, None), arrays)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names (none for other classes), kept per class: a
    stream's items are mostly of one class, so each is looked up once."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = ()
        if dataclasses.is_dataclass(cls):
            names = tuple(field.name for field in dataclasses.fields(cls))
        _FIELD_NAMES[cls] = names
    return names


def is_stream_error(error: BaseException) -> bool:
    """Whether ``error`` is MLX's complaint about another thread's stream."""
    return isinstance(error, RuntimeError) and _STREAM_ERROR in str(error)


def affinity_error(
    error: BaseException,
    job: Callable[..., object] | str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    thread_name: str,
) -> StreamAffinityError:
    """Build the :class:`StreamAffinityError` that replaces ``error``.

    Runs on the worker thread: each array argument is evaluated on its own to
    find the ones that belong to another thread's stream.
    """
    name = job_name(job)
    culprits = [
        (where, arg, owner)
        for where, arg in _named_arguments(args, kwargs)
        if (owner := _foreign_owner(arg)) is not None
    ]
    if culprits:
        parts = [
            f"{where} {_kind(arg)} built on {owner}" for where, arg, owner in culprits
        ]
        if any(holds_model(arg) for _, arg, _ in culprits):
            parts.append(
                "load the model through this MLXThread instead (thread.run_sync"
                "(load, path), an @on_mlx_thread loader, or a start-up job of"
                " MLXThreadMiddleware), so that its arrays belong to this thread"
            )
        if not all(holds_model(arg) for _, arg, _ in culprits):
            parts.append(
                "evaluate an array where it was built with mx.eval() before"
                " passing it, or build it inside the job"
            )
        advice = "; ".join(parts)
    elif owned := globals_owned_elsewhere():
        advice = (
            f"{', '.join(owned)} is a plain stream that one thread only can use"
            " (mlx-vlm < 0.5 and older mlx-lm make it at import): run every"
            " generation on that MLXThread, or upgrade to a version with a"
            " thread-local generation_stream"
        )
    else:
        advice = (
            "it used an array, model or stream created lazily on another thread;"
            " load the model and build its inputs through this MLXThread"
            " (for example load with thread.run_sync(load, path))"
        )
    return StreamAffinityError(
        f"Job {name!r} failed on MLX thread {thread_name!r} ({error}): {advice}."
    )


def _named_arguments(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, object]]:
    for index, arg in enumerate(args):
        yield f"argument {index}", arg
    for key, arg in kwargs.items():
        yield f"argument {key!r}", arg


def holds_model(value: object) -> bool:
    """Whether ``value`` is an ``mlx.nn.Module``, or a tuple or list with one."""
    return bool(models_in((value,), {}))


# How far into a tuple or list argument to look for a model: far enough for
# (model, processor), never a walk over a long list of tokens.
_MODELS_IN_A_SEQUENCE = 16


def models_in(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[object, ...]:
    """The ``mlx.nn.Module`` arguments of a call, and those one level inside a
    tuple or list argument (among its first 16 items)."""
    nn = sys.modules.get("mlx.nn")  # no model exists if it was never imported
    if nn is None:
        return ()
    module = nn.Module
    found: list[object] = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, module):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(
                item for item in arg[:_MODELS_IN_A_SEQUENCE] if isinstance(item, module)
            )
    return tuple(found)


def _kind(value: object) -> str:
    if isinstance(value, mx.array):
        return "is a lazy array"
    if holds_model(value):
        model = "is a model" if isinstance(value, Mapping) else "holds a model"
        return f"{model} whose lazy arrays were"
    return "holds lazy arrays"


def _foreign_owner(value: object) -> str | None:
    """Who owns the first array of ``value`` that cannot be evaluated here:
    "MLX thread 'name'" when known; None when every array evaluates."""
    for array in _arrays(value):
        error = _stream_error_here(array)
        if error is not None:
            owner = _stream_threads.get(_stream_index(error))
            return "another thread" if owner is None else f"MLX thread {owner!r}"
    return None


def _stream_index(text: str) -> int:
    """The stream index named in ``text``; -1 if none is."""
    match = _STREAM_INDEX.search(text)
    return -1 if match is None else int(match[1])


def _stream_error_here(array: object) -> str | None:
    """MLX's stream error for evaluating ``array`` here, None if it evaluates."""
    try:
        mx.eval(array)
    except RuntimeError as exc:
        if _STREAM_ERROR in str(exc):
            return str(exc)
        raise
    return None


def job_name(fn: object) -> str:
    """A readable name for a job: its qualified name, else its repr (a name
    given as a string is kept)."""
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    func = getattr(fn, "func", None)  # functools.partial
    return job_name(func) if func is not None else repr(fn)
