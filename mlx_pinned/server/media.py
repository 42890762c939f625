"""A request's images, videos and audio as plain values: the HTTP side makes
a ref per part, in prompt order; the decoders (:mod:`.inputs`) turn them
into images, :class:`Video` and :class:`Audio`, or refuse them by index.
Any thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .failures import AudioRefusedError, ImageRefusedError, VideoRefusedError

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = [
    "Audio",
    "AudioInput",
    "AudioLimits",
    "AudioRef",
    "Decoders",
    "ImageRef",
    "LoadAudio",
    "LoadAudios",
    "LoadImages",
    "LoadVideos",
    "Video",
    "VideoLimits",
    "VideoRef",
]


@dataclass(frozen=True)
class VideoLimits:
    """Limits on the videos of one request (``fps``: frames sampled per
    second where a request sets no ``video_fps``)."""

    max_videos: int = 2
    max_bytes: int = 16 * 1024 * 1024
    max_seconds: float = 600.0
    max_pixels: int = 1920 * 1080
    fps: float = 2.0
    max_frames: int = 32


@dataclass(frozen=True)
class AudioLimits:
    """Limits on an audio file, each checked from its header before it is
    decoded (its length again on what decoding gave)."""

    max_bytes: int = 20 * 1024 * 1024
    max_seconds: float = 1800.0
    max_channels: int = 8
    min_sample_rate: int = 8000
    max_sample_rate: int = 192000
    max_audios: int = 2


@dataclass(frozen=True)
class ImageRef:
    index: int
    url: str

    def error(self, message: str, code: str) -> ImageRefusedError:
        return ImageRefusedError(message, index=self.index, code=code)


#: Decodes (and, where allowed, fetches) a request's images, in order, off
#: the event loop; raises :class:`~.failures.ImageRefusedError`.
LoadImages = Callable[[Sequence[ImageRef]], Awaitable[list["Image.Image"]]]


@dataclass(frozen=True)
class VideoRef:
    """A video of the request and its sampling (None: the server's defaults)."""

    index: int
    url: str
    fps: float | None = None
    max_frames: int | None = None

    def error(self, message: str, code: str) -> VideoRefusedError:
        return VideoRefusedError(message, index=self.index, code=code)


@dataclass(frozen=True, eq=False)
class Video:
    """A decoded video.

    Attributes:
        frames: ``(T, 3, H, W)`` uint8 RGB frames, T even.
        fps: The source's frame rate.
        indices: Each sampled frame's index in the source.
        digest: A content hash of the frames (what the caches key on).
    """

    frames: np.ndarray[Any, Any]
    fps: float
    total_frames: int
    indices: tuple[int, ...]
    digest: int

    def metadata(self) -> dict[str, Any]:
        """What mlx-vlm's processors take as this video's ``video_metadata``."""
        return {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "frames_indices": list(self.indices),
            "height": int(self.frames.shape[2]),
            "width": int(self.frames.shape[3]),
            "duration": self.total_frames / self.fps,
        }


@dataclass(frozen=True, eq=False)
class Audio:
    """A decoded audio file: mono float32 samples at the model's rate (Hz);
    ``digest`` is what the caches key on."""

    samples: np.ndarray[Any, Any]
    sample_rate: int
    seconds: float
    digest: str


@dataclass(frozen=True)
class AudioInput:
    """How a model takes audio: the rate it hears at (Hz), and the longest
    file it hears (seconds; None: no limit of its own)."""

    sample_rate: int
    max_seconds: float | None = None


@dataclass(frozen=True)
class AudioRef:
    """An ``input_audio`` part: its base64 data, and the format the request
    says it is (the bytes must be that)."""

    index: int
    data: str
    format: str

    def error(self, message: str, code: str) -> AudioRefusedError:
        return AudioRefusedError(message, index=self.index, code=code)


#: As :data:`LoadImages`, for videos.
LoadVideos = Callable[[Sequence[VideoRef]], Awaitable[list[Video]]]

#: Decodes an audio file's bytes to mono samples at a sample rate.
LoadAudio = Callable[[bytes, int], Awaitable[Audio]]

#: Decodes a request's audio parts, in order, as a model takes them.
LoadAudios = Callable[[Sequence[AudioRef], AudioInput], Awaitable[list[Audio]]]


@dataclass(frozen=True)
class Decoders:
    """How a request's media is decoded off the event loop, under the
    server's limits; ``audio`` decodes an uploaded file."""

    images: LoadImages
    videos: LoadVideos
    audios: LoadAudios
    audio: LoadAudio
