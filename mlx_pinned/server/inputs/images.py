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

import io
from collections.abc import Sequence

import anyio
from PIL import Image, ImageOps

from ..config import ImageLimits
from ..media import ImageRef
from ._load import Fetcher, data_uri_bytes, decoders, load, too_large

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
#: Longest side over shortest: Qwen-VL's processors refuse more than 200:1,
#: with a ValueError in the middle of the request.
MAX_ASPECT_RATIO = 200


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
        raise too_large(ref, "image", len(data), limits.max_bytes)
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
    return await load(refs, decode_image, limits, "image", fetch=fetch, limiter=limiter)


def _data_uri_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    data, _ = data_uri_bytes(
        ref,
        "image",
        FORMATS,
        "image/png, image/jpeg, image/webp or image/gif",
        limits.max_bytes,
    )
    return data


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
