"""Untrusted images from chat requests, decoded to RGB PIL images.

Images arrive as ``data:`` URIs (PNG, JPEG, WebP, GIF's first frame). Every
limit is checked as early as it can be: the count before anything is decoded,
the encoded size before base64 is decoded, and the pixel count from the file's
header before the pixels are decoded, so a small file that claims a huge
canvas is refused without allocating it. Local paths and ``file://`` are
always refused; ``http(s)://`` URLs are refused unless a fetcher is given
(the server's is :class:`._remote.RemoteImageFetcher`, with SSRF rules).

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
from dataclasses import dataclass

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar
from PIL import Image, ImageOps

from ._remote import RemoteImageError
from .schemas import APIError, ImagePart, Message, UserMessage

__all__ = [
    "FORMATS",
    "ImageError",
    "ImageLimits",
    "ImageRef",
    "collect_image_refs",
    "decode_image",
    "load_images",
]

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
#: Longest side over shortest: Qwen-VL's processors refuse more than 200:1
#: (mlx-vlm raises a ValueError in the middle of the request: a 500).
MAX_ASPECT_RATIO = 200
# What rb"\s" matches; bytes.translate drops it about 6x faster than re.sub
# on a 10 MB payload, and holds the GIL that much less.
_WHITESPACE = b" \t\n\r\f\v"

#: Fetches a remote image URL and returns its bytes; raises
#: :class:`RemoteImageError` for a URL it refuses or cannot fetch.
Fetcher = Callable[[str], Awaitable[bytes]]


@dataclass(frozen=True)
class ImageLimits:
    """Limits on the images of one request.

    Attributes:
        max_images: Images per request, over all messages.
        max_bytes: Encoded (base64-decoded) bytes per image.
        max_pixels: Width times height per image, read from the header.
    """

    max_images: int = 8
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 4096 * 4096


class ImageError(APIError):
    """An image part that cannot be used; a 400 that names the part.

    Args:
        message: What is wrong and what to send instead.
        message_index: Index of the message in ``messages``.
        part_index: Index of the part in that message's ``content``.
        code: A short machine-readable code.
    """

    def __init__(
        self, message: str, *, message_index: int, part_index: int, code: str
    ) -> None:
        param = f"messages[{message_index}].content[{part_index}].image_url"
        super().__init__(
            400, f"Invalid image at '{param}': {message}", param=param, code=code
        )
        self.message_index = message_index
        self.part_index = part_index


@dataclass(frozen=True)
class ImageRef:
    """Where an image part is in the request, and its URL."""

    message_index: int
    part_index: int
    url: str

    def error(self, message: str, code: str) -> ImageError:
        """An :class:`ImageError` for this part."""
        return ImageError(
            message,
            message_index=self.message_index,
            part_index=self.part_index,
            code=code,
        )


def collect_image_refs(
    messages: Sequence[Message], limits: ImageLimits
) -> list[ImageRef]:
    """The image parts of ``messages`` in prompt order; checks the count.

    Raises:
        ImageError: More than ``limits.max_images`` images.
    """
    refs = [
        ImageRef(i, j, part.image_url.url)
        for i, message in enumerate(messages)
        if isinstance(message, UserMessage) and not isinstance(message.content, str)
        for j, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]
    if len(refs) > limits.max_images:
        raise refs[limits.max_images].error(
            f"too many images: {len(refs)} in this request, at most "
            f"{limits.max_images} are allowed.",
            "too_many_images",
        )
    return refs


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
        ImageError: Unsupported URL or format, bad base64, over a limit, corrupt.
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
        refs: The image parts, from :func:`collect_image_refs`.
        limits: The size limits.
        fetch: Fetches ``http(s)://`` URLs; when None they are refused. Its
            :class:`RemoteImageError` becomes a 400 that names the part.
        limiter: Bounds the requests decoding at once (default:
            :func:`decoders`, one per core).

    Raises:
        ImageError: The first image that cannot be used.
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
    together had 32 threads decoding, each wanting the GIL the event loop
    needs (``GET /health`` p99 under 32 streams: 9.5-10.1 ms with 1-2
    decoders, 7 runs; 10.7-12.3 ms with 40, 5 runs).
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


def _too_large(ref: ImageRef, size: int, limits: ImageLimits) -> ImageError:
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
