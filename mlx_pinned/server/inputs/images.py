"""Untrusted images (PNG, JPEG, WebP, GIF's first frame) decoded to RGB PIL
images, the pixel count read from the header before the pixels are decoded.
:func:`load_images` runs on the event loop and decodes in a worker thread.
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

#: MIME type → Pillow format name.
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
    """Decode one image to a fully loaded RGB image, on the calling thread;
    ``data``: its bytes, when fetched from a remote URL (else its URL must be
    a ``data:`` URI).

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
    """A request's images, in order: :func:`._load.load` of :func:`decode_image`.

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
