"""A request's images and videos as refs for the decoders, counted against
the server's limits: the same for every API.

Event loop (pure CPU). Each API's slice finds its own parts (where they are
in its request, and their URLs); these number them in prompt order and
refuse the first one past the limit, naming it by its index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from ..config import ImageLimits, VideoLimits
from ..media import ImageRef, VideoRef

__all__ = ["counted_image_refs", "counted_video_refs"]

R = TypeVar("R", ImageRef, VideoRef)


def counted_image_refs(urls: Iterable[str], limits: ImageLimits) -> list[ImageRef]:
    """An :class:`ImageRef` per URL, in order.

    Raises:
        ImageRefusedError: More than ``limits.max_images`` images.
    """
    refs = [ImageRef(index, url) for index, url in enumerate(urls)]
    return _at_most(refs, limits.max_images, "image")


def counted_video_refs(
    urls: Iterable[str],
    limits: VideoLimits,
    *,
    fps: float | None,
    max_frames: int | None,
) -> list[VideoRef]:
    """A :class:`VideoRef` per URL, in order, each with the request's
    sampling.

    Raises:
        VideoRefusedError: More than ``limits.max_videos`` videos.
    """
    refs = [VideoRef(i, url, fps, max_frames) for i, url in enumerate(urls)]
    return _at_most(refs, limits.max_videos, "video")


def _at_most(refs: Sequence[R], most: int, kind: str) -> list[R]:
    if len(refs) > most:
        raise refs[most].error(
            f"too many {kind}s: {len(refs)} in this request, at most "
            f"{most} are allowed.",
            f"too_many_{kind}s",
        )
    return list(refs)
