"""The disk tier's files (:mod:`.prompt_disk`): one format for prompt KV and
images' outputs (a length-prefixed JSON header with a checksum, then the
arrays' bytes), and the fingerprint of the model a file belongs to. Any
thread.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["FORMAT", "arrays", "header", "model_fingerprint", "read"]

#: The files' format (in each header, and in each model's fingerprint).
FORMAT = 2
#: Bytes of each weight file read into the model's fingerprint (its head).
HEAD_BYTES = 1 << 16
_LENGTH = struct.Struct("<Q")
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
    format (and, read whole, the checksum).

    Raises:
        ValueError: The file is not whole and unchanged (or KeyError,
            TypeError for a header that is not one).
    """
    with path.open("rb") as file:
        raw = file.read(_LENGTH.size)
        if len(raw) != _LENGTH.size:
            raise ValueError("it is too short to be a disk tier file")
        (length,) = _LENGTH.unpack(raw)
        text = file.read(length)
        if len(text) != length:
            raise ValueError("its header is cut short")
        found = json.loads(text)
        payload = b"" if header_only else file.read()
    if not isinstance(found, dict):
        raise ValueError("its header is not an object")
    if found.get("format") != FORMAT or found.get("model") != model:
        raise ValueError("of another format or model")
    fields = {k: v for k, v in found.items() if k != "checksum"}
    if not header_only and _checksum(fields, [payload]) != found.get("checksum"):
        raise ValueError("its checksum does not match (truncated or changed)")
    return found, payload


def arrays(found: dict[str, Any], payload: bytes) -> list[mx.array]:
    """The arrays a header describes, out of ``payload`` (evaluated)."""
    offset = 0
    out = []
    for dtype_name, shape in found["arrays"]:
        kind, stored = _DTYPES[dtype_name]
        count = int(np.prod(shape))
        size = count * np.dtype(stored).itemsize
        if offset + size > len(payload):
            raise ValueError("it is shorter than its header says")
        raw = np.frombuffer(payload, stored, count, offset)
        out.append(mx.array(raw.reshape(shape)).view(kind))
        offset += size
    if offset != len(payload):
        raise ValueError("it is longer than its header says")
    mx.eval(out)
    return out


def _spec(array: mx.array) -> tuple[str, list[int]]:
    return str(array.dtype).rpartition(".")[2], list(array.shape)


def _checksum(fields: dict[str, Any], payload: Sequence[Any]) -> str:
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode())
    for piece in payload:
        digest.update(piece)
    return digest.hexdigest()
