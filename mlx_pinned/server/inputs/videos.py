"""Untrusted videos (MP4, WebM, QuickTime, AVI, Matroska) sampled to RGB
frames with OpenCV, each limit checked from the container's header before a
frame is decoded. OpenCV reads from a path only, so the bytes go to a
private temporary file. :func:`load_videos` runs on the event loop and
decodes in a worker thread.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from ..config import VideoLimits
from ..failures import VideoRefusedError
from ..media import Video, VideoRef
from ._load import Fetcher, data_uri_bytes, load, too_large

__all__ = ["FORMATS", "MAX_SOURCE_FPS", "decode_video", "load_videos"]

#: MIME type → the file suffix OpenCV is given.
FORMATS: dict[str, str] = {
    "video/mp4": ".mp4",
    "video/webm": ".webm",
    "video/quicktime": ".mov",
    "video/x-msvideo": ".avi",
    "video/avi": ".avi",
    "video/x-matroska": ".mkv",
}
#: A claimed frame rate above this is no camera's: the file is refused.
MAX_SOURCE_FPS = 240.0


def decode_video(
    ref: VideoRef, limits: VideoLimits, data: bytes | None = None
) -> Video:
    """Decode and sample one video, on the calling thread; ``data``: its
    bytes, when fetched from a remote URL (else its URL must be a ``data:``
    URI).

    Raises:
        VideoRefusedError: Unsupported URL or format, bad base64, over a
            limit, undecodable.
    """
    suffix = ".mp4"
    if data is None:
        data, suffix = _data_uri_bytes(ref, limits)
    if len(data) > limits.max_bytes:
        raise too_large(ref, "video", len(data), limits.max_bytes)
    import cv2

    with tempfile.NamedTemporaryFile(suffix=suffix) as file:
        file.write(data)
        file.flush()
        capture = cv2.VideoCapture(file.name, cv2.CAP_FFMPEG)
        try:
            return _sample(ref, limits, capture, data)
        finally:
            capture.release()


def _sample(ref: VideoRef, limits: VideoLimits, capture: Any, data: bytes) -> Video:
    import cv2

    if not capture.isOpened():
        raise _undecodable(ref)
    total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    fps = float(capture.get(cv2.CAP_PROP_FPS))
    width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
    height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if total <= 0 or width <= 0 or height <= 0 or not 0 < fps <= MAX_SOURCE_FPS:
        raise _undecodable(ref)
    if width * height > limits.max_pixels:
        raise ref.error(
            f"the video's frames are {width}x{height} = {width * height} pixels; "
            f"at most {limits.max_pixels} are allowed.",
            "video_too_large",
        )
    seconds = total / fps
    if seconds > limits.max_seconds:
        raise ref.error(
            f"the video is {seconds:.1f} s long; at most {limits.max_seconds:g} s "
            "are allowed.",
            "video_too_long",
        )
    wanted = _indices(total, fps, ref, limits)
    frames: list[np.ndarray[Any, Any]] = []
    read: list[int] = []
    position = 0
    for index in wanted:
        while position < index:
            if not capture.grab():
                break
            position += 1
        ok, frame = capture.read() if position == index else (False, None)
        if not ok or frame is None:
            break
        position += 1
        if frame.shape[:2] != (height, width):
            raise _undecodable(ref)
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        read.append(index)
    if not frames:
        raise _undecodable(ref)
    if len(frames) % 2:  # a temporal patch is two frames
        frames.append(frames[-1])
        read.append(read[-1])
    stacked = np.ascontiguousarray(np.stack(frames).transpose(0, 3, 1, 2))
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(stacked.shape).encode())
    digest.update(stacked.tobytes())
    return Video(
        frames=stacked,
        fps=fps,
        total_frames=total,
        indices=tuple(read),
        digest=int.from_bytes(digest.digest(), "little") & (2**62 - 1),
    )


def _indices(total: int, fps: float, ref: VideoRef, limits: VideoLimits) -> list[int]:
    """The source frames to keep: ``video_fps`` per second, evenly spread,
    at most ``video_max_frames`` and the source's count, and even where more
    than one (Qwen-VL's temporal patches are two frames)."""
    rate = ref.fps if ref.fps is not None else limits.fps
    cap = min(ref.max_frames or limits.max_frames, limits.max_frames)
    count = max(1, min(math.floor(total / fps * rate), cap, total))
    if count > 1 and count % 2:
        count -= 1
    return sorted({int(i) for i in np.linspace(0, total - 1, count).round()})


async def load_videos(
    refs: Sequence[VideoRef],
    limits: VideoLimits,
    *,
    fetch: Fetcher | None = None,
    limiter: anyio.CapacityLimiter | None = None,
) -> list[Video]:
    """A request's videos, in order: :func:`._load.load` of :func:`decode_video`.

    Raises:
        VideoRefusedError: The first video that cannot be used.
    """
    return await load(refs, decode_video, limits, "video", fetch=fetch, limiter=limiter)


def _data_uri_bytes(ref: VideoRef, limits: VideoLimits) -> tuple[bytes, str]:
    send = ", ".join(sorted(set(FORMATS)))
    data, mime = data_uri_bytes(ref, "video", FORMATS, send, limits.max_bytes)
    return data, FORMATS[mime]


def _undecodable(ref: VideoRef) -> VideoRefusedError:
    return ref.error(
        "the data is not an MP4, WebM, QuickTime, AVI or Matroska video OpenCV "
        "can decode, or it is corrupt.",
        "invalid_video",
    )
