"""Small deterministic test images, encoded, or as ``data:`` URIs.

Runs on the calling thread; no MLX is involved. Pillow is imported on use.
"""

from __future__ import annotations

import base64
import io
import random
from typing import Final

_MIME: Final = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_MIME_ALIASES: Final = {"JPG": "JPEG"}


def make_test_image(
    width: int = 64, height: int = 64, fmt: str = "JPEG", seed: int = 0
) -> bytes:
    """Encode a small deterministic picture: a background and a few shapes.

    Args:
        width: Width in pixels.
        height: Height in pixels.
        fmt: A Pillow format name such as ``"JPEG"``, ``"PNG"`` or ``"WEBP"``.
        seed: Picks the colours and shapes; the same arguments give the same
            bytes with the same Pillow.

    Runs on the calling thread; no MLX is involved.

    Returns:
        The encoded image.

    Raises:
        ValueError: ``width`` or ``height`` is not positive.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"Pass a positive width and height, not {width}x{height}.")
    from PIL import Image, ImageDraw

    rng = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    image = Image.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(image)
    for index in range(4):
        x0, x1 = sorted(rng.randrange(width) for _ in range(2))
        y0, y1 = sorted(rng.randrange(height) for _ in range(2))
        shape = draw.ellipse if index % 2 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour())
    buffer = io.BytesIO()
    image.save(buffer, format=_format_name(fmt))
    return buffer.getvalue()


def image_data_uri(
    width: int = 64, height: int = 64, fmt: str = "JPEG", seed: int = 0
) -> str:
    """Return :func:`make_test_image` as a base64 ``data:`` URI.

    Args:
        width: Width in pixels.
        height: Height in pixels.
        fmt: ``"JPEG"``, ``"PNG"`` or ``"WEBP"``.
        seed: Picks the colours and shapes.

    Returns:
        A URI such as ``data:image/jpeg;base64,...``, the form OpenAI-style
        ``image_url`` content parts carry.

    Raises:
        ValueError: The format has no known MIME type, or the size is not
            positive.
    """
    name = _format_name(fmt)
    if name not in _MIME:
        raise ValueError(f"Use one of {sorted(_MIME)} for a data URI, not {fmt!r}.")
    encoded = base64.b64encode(make_test_image(width, height, name, seed))
    return f"data:{_MIME[name]};base64,{encoded.decode('ascii')}"


def _format_name(fmt: str) -> str:
    name = fmt.upper()
    return _MIME_ALIASES.get(name, name)
