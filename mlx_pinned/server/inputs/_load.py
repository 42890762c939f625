"""What loading images and videos share: the ``data:`` URI, the remote
fetch, the decoders' bound. :func:`load` runs on the event loop, the rest
on the worker thread it hands decoding to. ``kind`` spells the error codes.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Literal, Protocol, TypeVar

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

from ..failures import MediaRefusedError
from .remote import RemoteImageError

__all__ = [
    "Fetcher",
    "Kind",
    "MediaRef",
    "data_uri_bytes",
    "decoders",
    "load",
    "too_large",
]

#: Fetches a remote URL's bytes; raises :class:`RemoteImageError`.
Fetcher = Callable[[str], Awaitable[bytes]]
Kind = Literal["image", "video"]

# The scheme is case-insensitive (RFC 3986): "DATA:" is a data URI too.
_DATA_URI = re.compile(
    r"\s*data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.ASCII | re.IGNORECASE
)
# What rb"\s" matches; bytes.translate drops it faster than re.sub, and
# holds the GIL less.
_WHITESPACE = b" \t\n\r\f\v"


class MediaRef(Protocol):
    """An :class:`~..media.ImageRef` or a :class:`~..media.VideoRef`."""

    @property
    def url(self) -> str: ...

    def error(self, message: str, code: str) -> MediaRefusedError: ...


R = TypeVar("R", bound=MediaRef)
L = TypeVar("L")
T = TypeVar("T")


async def load(
    refs: Sequence[R],
    decode: Callable[[R, L, bytes | None], T],
    limits: L,
    kind: Kind,
    *,
    fetch: Fetcher | None,
    limiter: anyio.CapacityLimiter | None,
) -> list[T]:
    """Fetch the remote ones (refused where ``fetch`` is None), then
    ``decode`` each under ``limits``, given its fetched bytes, in a worker
    thread under ``limiter`` (default: :func:`decoders`), in order.

    Runs on the event loop. A cancelled caller is released once the decoding
    in progress ends (so the decoders' bound holds), and its result is
    dropped.

    Raises:
        MediaRefusedError: The first part that cannot be used.
    """
    payloads: list[bytes | None] = []
    for ref in refs:
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme in ("http", "https"):
            if fetch is None:
                raise ref.error(
                    f"remote {kind} URLs are not enabled on this server; send the "
                    f"{kind} inline as a base64 data: URI, or start the server with "
                    "--allow-remote-images.",
                    f"remote_{kind}s_disabled",
                )
            try:
                payloads.append(await fetch(ref.url))
            except RemoteImageError as exc:
                raise ref.error(exc.message, exc.code) from None
        else:
            payloads.append(None)

    def decode_all() -> list[T]:
        return [decode(r, limits, p) for r, p in zip(refs, payloads, strict=True)]

    if not refs:
        return []
    return await anyio.to_thread.run_sync(decode_all, limiter=limiter or decoders())


_DECODERS: RunVar[anyio.CapacityLimiter] = RunVar("mlx_pinned_image_decoders")


def decoders() -> anyio.CapacityLimiter:
    """The event loop's bound on media decodes at once: one per core, not
    anyio's 40 threads, each wanting the GIL the event loop needs."""
    try:
        return _DECODERS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(os.cpu_count() or 1)
        _DECODERS.set(limiter)
        return limiter


def data_uri_bytes(
    ref: MediaRef, kind: Kind, formats: Collection[str], send: str, max_bytes: int
) -> tuple[bytes, str]:
    """The decoded bytes of a base64 ``data:`` URI, and its MIME type
    (one of ``formats``; ``send`` lists them in the refusal).

    Raises:
        MediaRefusedError: Not a ``data:`` URI, a type not in ``formats``,
            not base64, over ``max_bytes``.
    """
    url = ref.url
    match = _DATA_URI.match(url)
    if match is None:
        if url.lstrip().lower().startswith("file:") or "://" not in url:
            raise ref.error(
                f"local files are never read; send the {kind} inline as a base64 "
                "data: URI.",
                f"invalid_{kind}_url",
            )
        raise ref.error(
            f"only data: URIs are supported; send the {kind} inline as a base64 "
            "data: URI.",
            f"invalid_{kind}_url",
        )
    mime = match["mime"].strip().lower()
    if mime not in formats:
        raise ref.error(
            f"unsupported {kind} type {mime or '(none)'!r}; send {send}.",
            f"invalid_{kind}_format",
        )
    if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
        raise ref.error(
            f"the data: URI must be base64-encoded (data:{kind}/...;base64,...).",
            "invalid_base64",
        )
    payload = url[match.end() :].encode("ascii", "replace").translate(None, _WHITESPACE)
    # Base64 grows data by 4/3: refuse before decoding anything.
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise too_large(ref, kind, len(payload) // 4 * 3, max_bytes)
    try:
        return base64.b64decode(payload, validate=True), mime
    except (binascii.Error, ValueError):
        raise ref.error(
            "the data: URI is not valid base64.", "invalid_base64"
        ) from None


def too_large(
    ref: MediaRef, kind: Kind, size: int, max_bytes: int
) -> MediaRefusedError:
    return ref.error(
        f"the {kind} is {size} bytes; at most {max_bytes} are allowed.",
        f"{kind}_too_large",
    )
