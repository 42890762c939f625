"""The disk tier's files (:mod:`.prompt_disk`): one format for prompt KV
(and states) and images' outputs (a length-prefixed JSON header with a
checksum, then the arrays' bytes), and the fingerprint of the model a file
belongs to. Any thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .checkpoints import Marks, State, StateCheck, decode

__all__ = ["FORMAT", "arrays", "header", "layers", "model_fingerprint", "read"]

#: The files' format (in each header, and in each model's fingerprint).
FORMAT = 4
#: Bytes of each weight file read into the model's fingerprint (its head).
HEAD_BYTES = 1 << 16
_LENGTH = struct.Struct("<Q")
_MAX_DIM = 2**31  # MLX's shapes are int32
_DTYPES: dict[str, tuple[Any, Any]] = {
    # name: (MLX dtype, the NumPy dtype its bytes are read as)
    "float32": (mx.float32, np.float32),
    "float16": (mx.float16, np.float16),
    "bfloat16": (mx.bfloat16, np.uint16),
    "uint32": (mx.uint32, np.uint32),
}


def model_fingerprint(path: str, quantization: str = "") -> str:
    """What a file must match to be served by this model: its folder's config
    and each weight file's name, size and head (or a hub id), how its KV is
    quantized, and the format."""
    digest = hashlib.blake2b(f"{FORMAT}:{quantization}".encode(), digest_size=16)
    folder = Path(path)
    if not folder.is_dir():
        digest.update(path.encode())
        return digest.hexdigest()
    for file in sorted(folder.iterdir()):
        if file.name == "config.json":
            digest.update(file.read_bytes())
        elif file.suffix == ".safetensors":
            with file.open("rb") as weights:
                head = weights.read(HEAD_BYTES)
            digest.update(f"{file.name}:{file.stat().st_size}:".encode() + head)
    return digest.hexdigest()


def header(model: str, payload: Sequence[Any], meta: dict[str, Any]) -> bytes:
    """The length-prefixed header of a file of ``model``'s holding ``payload``
    (evaluated, contiguous arrays) and its kind's ``meta``."""
    fields = {
        "format": FORMAT,
        "model": model,
        "arrays": [_spec(array) for array in payload],
        **meta,
    }
    checksum = _checksum(fields, [memoryview(array) for array in payload])
    text = json.dumps({**fields, "checksum": checksum}).encode()
    return _LENGTH.pack(len(text)) + text


def read(
    path: Path, model: str, *, header_only: bool = False
) -> tuple[dict[str, Any], bytes]:
    """A file's header and its arrays' bytes, checked against ``model`` and the
    format (and, read whole, the checksum). Every field is bounded by the
    file's size before it is used: no value in a file can make it read past
    its end or allocate more than it holds.

    Raises:
        ValueError: The file is not whole, unchanged and this model's.
    """
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        raw = file.read(_LENGTH.size)
        if len(raw) != _LENGTH.size:
            raise ValueError("it is too short to be a disk tier file")
        (length,) = _LENGTH.unpack(raw)
        if length > size - _LENGTH.size:
            raise ValueError(f"its header length ({length}) is past its end")
        found = _header(file.read(length), model)
        payload_size = size - _LENGTH.size - length
        if payload_size != sum(_nbytes(spec) for spec in found["arrays"]):
            raise ValueError("its size is not what its header says")
        payload = b"" if header_only else file.read(payload_size)
    if not header_only and len(payload) != payload_size:
        raise ValueError("it was cut short while read")
    fields = {k: v for k, v in found.items() if k != "checksum"}
    if not header_only and _checksum(fields, [payload]) != found["checksum"]:
        raise ValueError("its checksum does not match (truncated or changed)")
    return found, payload


def arrays(found: dict[str, Any], payload: bytes) -> list[mx.array]:
    """The arrays a header :func:`read` checked describes, out of ``payload``
    (evaluated)."""
    offset = 0
    out = []
    for dtype_name, shape in found["arrays"]:
        kind, stored = _DTYPES[dtype_name]
        count = math.prod(shape)
        raw = np.frombuffer(payload, stored, count, offset)
        out.append(mx.array(raw.reshape(shape)).view(kind))
        offset += count * np.dtype(stored).itemsize
    mx.eval(out)
    return out


def _header(text: bytes, model: str) -> dict[str, Any]:
    """A header's fields, once its format, model and arrays are known good."""
    try:
        found = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"its header is not JSON ({exc})") from None
    if not isinstance(found, dict):
        raise ValueError("its header is not an object")
    if found.get("format") != FORMAT or found.get("model") != model:
        raise ValueError("of another format or model")
    specs = found.get("arrays")
    if not isinstance(specs, list) or not all(map(_is_spec, specs)):
        raise ValueError("its header's arrays are not dtypes and shapes")
    if not isinstance(found.get("checksum"), str):
        raise ValueError("its header has no checksum")
    return found


def _is_spec(spec: Any) -> bool:
    return (
        isinstance(spec, list)
        and len(spec) == 2
        and isinstance(spec[0], str)
        and spec[0] in _DTYPES
        and isinstance(spec[1], list)
        and all(type(dim) is int and 0 <= dim < _MAX_DIM for dim in spec[1])
    )


def _nbytes(spec: list[Any]) -> int:
    dtype_name, shape = spec
    return int(math.prod(shape)) * int(np.dtype(_DTYPES[dtype_name][1]).itemsize)


def _spec(array: mx.array) -> tuple[str, list[int]]:
    return str(array.dtype).rpartition(".")[2], list(array.shape)


def _checksum(fields: dict[str, Any], payload: Sequence[Any]) -> str:
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode())
    for piece in payload:
        digest.update(piece)
    return digest.hexdigest()


def layers(
    header: dict[str, Any], arrays: list[mx.array], tokens: int, check: StateCheck
) -> tuple[list[tuple[Any, Any] | None], Marks]:
    """A prompt cache entry's KV layers (its header's ``layers``: a layer's
    keys, then its values, of one array or of a quantized three, each
    (1, H, T, D) with ``tokens`` tokens; None where the layer keeps a
    state) and its states at each mark, each checked by ``check``.

    Raises:
        ValueError: They are not what the header says, or ``check`` refuses
            a state.
    """
    specs = header.get("layers")
    if (
        not isinstance(specs, list)
        or not specs
        or not all(
            layer is None
            or (
                isinstance(layer, list)
                and len(layer) == 2
                and all(type(count) is int and count > 0 for count in layer)
            )
            for layer in specs
        )
    ):
        raise ValueError("its layers are not KV or states")
    used = sum(sum(layer) for layer in specs if layer is not None)
    if used > len(arrays) or any(
        a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != tokens for a in arrays[:used]
    ):
        raise ValueError("its arrays do not hold its key's tokens")
    kv: list[tuple[Any, Any] | None] = []
    rest = arrays[:used]
    for layer in specs:
        if layer is None:
            kv.append(None)
            continue
        parts = []
        for count in layer:
            pieces, rest = rest[:count], rest[count:]
            parts.append(tuple(pieces) if count > 1 else pieces[0])
        kv.append((parts[0], parts[1]))
    marks = _states(header.get("marks"), kv, arrays, used, tokens, check)
    if any(layer is None for layer in kv) and not marks:
        raise ValueError("it keeps states but no mark")
    return kv, marks


def _states(
    found: Any,
    kv: list[tuple[Any, Any] | None],
    arrays: list[mx.array],
    used: int,
    tokens: int,
    check: StateCheck,
) -> Marks:
    """Each mark's states, every array after the KV ones used once, in order."""
    if not isinstance(found, list):
        raise ValueError("its marks are not a list")
    taken = [used]
    marks: Marks = {}
    for mark in found:
        if not (
            isinstance(mark, list)
            and len(mark) == 2
            and type(mark[0]) is int
            and 0 < mark[0] <= tokens
            and mark[0] not in marks
            and isinstance(mark[1], list)
            and len(mark[1]) == len(kv)
        ):
            raise ValueError("its marks are not positions and states")
        at, specs = mark
        states: list[State | None] = []
        for index, (spec, pair) in enumerate(zip(specs, kv, strict=True)):
            if (spec is None) != (pair is not None):
                raise ValueError("its marks hold states of KV layers")
            state = None if spec is None else State(decode(spec, arrays, taken))
            if state is not None:
                check(index, state, at)
            states.append(state)
        marks[at] = states
    if taken[0] != len(arrays):
        raise ValueError("its arrays are not its layers' and states'")
    return marks
