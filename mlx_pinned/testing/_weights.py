"""Random weights for a family, drawn with NumPy in the shapes of mlx-vlm's
own model class. Calling thread, except the one model build per family.
"""

from __future__ import annotations

import importlib
import pathlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

Specs = tuple[tuple[str, tuple[int, ...]], ...]

_SPECS_LOCK = threading.Lock()
_specs: dict[tuple[str, str], Specs] = {}


def parameter_specs(
    module: str, build: Callable[[Any], Any], *, kind: str = ""
) -> Specs:
    """Return the sorted (name, shape) of every parameter of ``build(module)``.

    The model is built once per process, module and ``kind`` (the build's
    name: BERT's sequence classifier beside its encoder), on a private
    thread: building it makes lazy MLX arrays, which bind a stream to the
    building thread, and a process whose worker threads still hold MLX
    streams can abort at exit. The private thread clears its streams before it ends.
    """
    # Import mlx-vlm here, on the caller's thread: mlx-vlm < 0.5 makes its
    # plain generation_stream at import, for the importing thread.
    imported = importlib.import_module(module)
    with _SPECS_LOCK:
        if (module, kind) not in _specs:
            found: list[Specs] = []
            errors: list[BaseException] = []

            def run() -> None:
                import mlx.core as mx

                try:
                    found.append(_build_specs(imported, build))
                except BaseException as exc:  # re-raised on the caller
                    errors.append(exc)
                finally:
                    mx.clear_streams()

            worker = threading.Thread(target=run, name="mlx-pinned-tiny-vlm")
            worker.start()
            worker.join()
            if errors:
                raise errors[0]
            _specs[module, kind] = found[0]
        return _specs[module, kind]


def _build_specs(module: Any, build: Callable[[Any], Any]) -> Specs:
    from mlx.utils import tree_flatten

    flat = cast("list[tuple[str, Any]]", tree_flatten(build(module).parameters()))
    return tuple(sorted((name, tuple(value.shape)) for name, value in flat))


def write_weights(
    file: pathlib.Path,
    seed: int,
    specs: Specs,
    zero_rows: dict[str, Iterable[int]],
    adjust: Callable[[str, Any], Any] | None = None,
    *,
    dtype: str | None = None,
) -> None:
    """Draw the weights from ``seed`` with NumPy and save them with MLX, as
    ``dtype`` (None: as drawn or adjusted).

    Matrices are normal over the square root of their fan-in, biases zero,
    other vectors (norm scales) one. ``zero_rows``: rows set to zero per
    parameter (embedding rows of tokens greedy decoding must never pick).
    ``adjust``: given each parameter's name and drawn value, returns the
    value to save (a family's own touches).

    NumPy, not ``mx.random``: drawing MLX random numbers binds a stream to the
    calling thread (see :func:`parameter_specs`), and a NumPy generator is
    seeded per call, so concurrent calls cannot disturb each other.
    """
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in specs:
        if len(shape) > 1:
            fan_in = int(np.prod(shape[1:]))
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)
        elif name.endswith("bias"):
            value = np.zeros(shape, dtype=np.float32)
        else:  # norm scales
            value = np.ones(shape, dtype=np.float32)
        if name in zero_rows:
            value[list(zero_rows[name])] = 0.0
        if adjust is not None:
            value = adjust(name, value)
        # A mx.array made from host memory is already evaluated, even when
        # converted on the way: no stream.
        weights[name] = mx.array(
            value, dtype=None if dtype is None else getattr(mx, dtype)
        )
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
