"""Untrusted images from chat requests, decoded to RGB PIL images.

Images arrive as ``data:`` URIs (PNG, JPEG, WebP, GIF's first frame). Every
limit is checked as early as it can be: the count (by the HTTP side) before
anything is decoded, the encoded size before base64 is decoded, and the pixel
count from the file's header before the pixels are decoded, so a small file
that claims a huge canvas is refused without allocating it. Local paths and
``file://`` are always refused; ``http(s)://`` URLs are refused unless a
fetcher is given (the server's is :class:`.remote.RemoteImageFetcher`, with SSRF rules).

Decoding is CPU work that does not touch MLX, so :func:`load_images` runs it in
a worker thread: off the event loop and off the MLX thread.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar
from PIL import Image, ImageOps

from ..config import ImageLimits
from ..failures import ImageRefusedError
from ..media import ImageRef
from .remote import RemoteImageError

__all__ = ["FORMATS", "Fetcher", "decode_image", "decoders", "load_images"]

#: MIME type → Pillow format name, for the formats this server accepts.
FORMATS: dict[str, str] = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
}

_PIL_FORMATS = sorted(set(FORMATS.values()))
# The scheme is case-insensitive (RFC 3986): "DATA:" is a data URI too.
_DATA_URI = re.compile(
    r"\s*data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.ASCII | re.IGNORECASE
)
#: Longest side over shortest: Qwen-VL's processors refuse more than 200:1,
#: with a ValueError in the middle of the request.
MAX_ASPECT_RATIO = 200
# What rb"\s" matches; bytes.translate drops it about 6x faster than re.sub
# on a 10 MB payload, and holds the GIL that much less.
_WHITESPACE = b" \t\n\r\f\v"

#: Fetches a remote image URL and returns its bytes; raises
#: :class:`RemoteImageError` for a URL it refuses or cannot fetch.
Fetcher = Callable[[str], Awaitable[bytes]]


def decode_image(
    ref: ImageRef, limits: ImageLimits, data: bytes | None = None
) -> Image.Image:
    """Decode one image to a fully loaded RGB image.

    Runs on the calling thread; pure CPU, never touches MLX.

    Args:
        ref: The image part; its URL must be a ``data:`` URI unless ``data`` is
            given.
        limits: The size limits.
        data: The encoded bytes, when already fetched from a remote URL.

    Raises:
        ImageRefusedError: Unsupported URL or format, bad base64, over a limit,
            corrupt.
    """
    if data is None:
        data = _data_uri_bytes(ref, limits)
    if len(data) > limits.max_bytes:
        raise _too_large(ref, len(data), limits)
    try:
        # Reads the header only. Pillow's own bomb check fires (past about 89
        # megapixels) before ours; it is refused the same way.
        image = Image.open(io.BytesIO(data), formats=_PIL_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ref.error(
            f"the image is larger than {limits.max_pixels} pixels.", "image_too_large"
        ) from None
    except (OSError, SyntaxError, ValueError):
        raise ref.error(
            "the data is not a PNG, JPEG, WebP or GIF image, or it is corrupt.",
            "invalid_image",
        ) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ref.error(
            f"the image is {width}x{height} = {width * height} pixels; at most "
            f"{limits.max_pixels} are allowed.",
            "image_too_large",
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ref.error(
            f"the image is {width}x{height}: its long side may be at most "
            f"{MAX_ASPECT_RATIO} times its short side; crop or pad it.",
            "invalid_image",
        )
    try:
        return _to_rgb(image)
    except (OSError, SyntaxError, ValueError, EOFError):
        raise ref.error(
            f"the {image.format} image is truncated or corrupt.", "invalid_image"
        ) from None


async def load_images(
    refs: Sequence[ImageRef],
    limits: ImageLimits,
    *,
    fetch: Fetcher | None = None,
    limiter: anyio.CapacityLimiter | None = None,
) -> list[Image.Image]:
    """Decode the images of a request in a worker thread, in order.

    Runs on the event loop; decoding runs in an anyio worker thread (neither
    the event loop nor the MLX thread). A cancelled caller is released once
    the decoding in progress ends (so the decoders' bound holds), and its
    result is dropped.

    Args:
        refs: The image parts, in prompt order.
        limits: The size limits.
        fetch: Fetches ``http(s)://`` URLs; when None they are refused. Its
            :class:`RemoteImageError` becomes an ``ImageRefusedError``.
        limiter: Bounds the requests decoding at once (default:
            :func:`decoders`, one per core).

    Raises:
        ImageRefusedError: The first image that cannot be used.
    """
    payloads: list[bytes | None] = []
    for ref in refs:
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme in ("http", "https"):
            if fetch is None:
                raise ref.error(
                    "remote image URLs are not enabled on this server; send the "
                    "image inline as a base64 data: URI, or start the server with "
                    "--allow-remote-images.",
                    "remote_images_disabled",
                )
            try:
                payloads.append(await fetch(ref.url))
            except RemoteImageError as exc:
                raise ref.error(exc.message, exc.code) from None
        else:
            payloads.append(None)

    def decode_all() -> list[Image.Image]:
        return [decode_image(r, limits, p) for r, p in zip(refs, payloads, strict=True)]

    if not refs:
        return []
    return await anyio.to_thread.run_sync(decode_all, limiter=limiter or decoders())


_DECODERS: RunVar[anyio.CapacityLimiter] = RunVar("mlx_pinned_image_decoders")


def decoders() -> anyio.CapacityLimiter:
    """The event loop's bound on image decodes at once: one per core.

    anyio's shared limiter allows 40 worker threads: 32 requests arriving
    together would have 32 threads decoding, each wanting the GIL the event
    loop needs (docs/benchmarks.md measures ``GET /health`` both ways).
    """
    try:
        return _DECODERS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(os.cpu_count() or 1)
        _DECODERS.set(limiter)
        return limiter


def _data_uri_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    url = ref.url
    match = _DATA_URI.match(url)
    if match is None:
        if url.lstrip().lower().startswith("file:") or "://" not in url:
            raise ref.error(
                "local files are never read; send the image inline as a base64 "
                "data: URI.",
                "invalid_image_url",
            )
        raise ref.error(
            "only data: URIs are supported; send the image inline as a base64 "
            "data: URI.",
            "invalid_image_url",
        )
    mime = match["mime"].strip().lower()
    if mime not in FORMATS:
        raise ref.error(
            f"unsupported image type {mime or '(none)'!r}; send image/png, "
            "image/jpeg, image/webp or image/gif.",
            "invalid_image_format",
        )
    if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
        raise ref.error(
            "the data: URI must be base64-encoded (data:image/...;base64,...).",
            "invalid_base64",
        )
    payload = url[match.end() :].encode("ascii", "replace").translate(None, _WHITESPACE)
    # Base64 grows data by 4/3: refuse before decoding anything.
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise _too_large(ref, len(payload) // 4 * 3, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ref.error(
            "the data: URI is not valid base64.", "invalid_base64"
        ) from None


def _too_large(ref: ImageRef, size: int, limits: ImageLimits) -> ImageRefusedError:
    return ref.error(
        f"the image is {size} bytes; at most {limits.max_bytes} are allowed.",
        "image_too_large",
    )


def _to_rgb(image: Image.Image) -> Image.Image:
    """The first frame, upright, on white where it was transparent, as RGB."""
    image.seek(0)
    image.load()
    image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
