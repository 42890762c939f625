"""A request's images, videos and audio, as plain values: where each one
is, a video or an audio file once decoded, and the limits their decoders
take.

A shared module: no Starlette, no pydantic, no MLX. The HTTP side makes an
:class:`ImageRef` or a :class:`VideoRef` per part of a request, in prompt
order, and an :class:`AudioRef` per audio part; the decoders
(:mod:`.inputs`, on worker threads) turn them into images, :class:`Video`
and :class:`Audio` values, or refuse them with the domain errors of
:mod:`.failures`, naming the part by its index.
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
    """Limits on the videos of one request, as the decoder takes them
    (:attr:`~.config.ServerConfig.video_limits`; ``fps``: frames sampled per second
    where a request sets no ``video_fps``)."""

    max_videos: int = 2
    max_bytes: int = 16 * 1024 * 1024
    max_seconds: float = 600.0
    max_pixels: int = 1920 * 1080
    fps: float = 2.0
    max_frames: int = 32


@dataclass(frozen=True)
class AudioLimits:
    """Limits on an audio file, as the decoder takes them
    (:attr:`~.config.ServerConfig.audio_limits`), each checked from the file's header
    before it is decoded (its length again on what decoding gave)."""

    max_bytes: int = 20 * 1024 * 1024
    max_seconds: float = 1800.0
    max_channels: int = 8
    min_sample_rate: int = 8000
    max_sample_rate: int = 192000
    max_audios: int = 2


@dataclass(frozen=True)
class ImageRef:
    """An image of the request: which one, in prompt order, and its URL."""

    index: int
    url: str

    def error(self, message: str, code: str) -> ImageRefusedError:
        """An :class:`~.failures.ImageRefusedError` for this image."""
        return ImageRefusedError(message, index=self.index, code=code)


#: Decodes (and, where allowed, fetches) a request's images, in order, off
#: the event loop; raises :class:`~.failures.ImageRefusedError` for the first
#: it cannot use.
LoadImages = Callable[[Sequence[ImageRef]], Awaitable[list["Image.Image"]]]


@dataclass(frozen=True)
class VideoRef:
    """A video of the request: which one, in prompt order, its URL, and the
    request's sampling (None: the server's defaults)."""

    index: int
    url: str
    fps: float | None = None
    max_frames: int | None = None

    def error(self, message: str, code: str) -> VideoRefusedError:
        """A :class:`~.failures.VideoRefusedError` for this video."""
        return VideoRefusedError(message, index=self.index, code=code)


@dataclass(frozen=True, eq=False)
class Video:
    """A decoded video: its sampled frames and where they are in the source.

    Attributes:
        frames: ``(T, 3, H, W)`` uint8 RGB frames, T even.
        fps: The source's frame rate.
        total_frames: The source's frame count.
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
    """A decoded audio file.

    Attributes:
        samples: Mono float32 samples.
        sample_rate: Their rate (Hz): the rate the model takes.
        seconds: Its length.
        digest: A content hash of the samples (what the caches key on).
    """

    samples: np.ndarray[Any, Any]
    sample_rate: int
    seconds: float
    digest: str


@dataclass(frozen=True)
class AudioInput:
    """How a model takes audio: the rate it hears at (Hz), and the longest
    file it hears (seconds; None: no limit of its own), which the decoder
    checks from a file's header with the server's own limits."""

    sample_rate: int
    max_seconds: float | None = None


@dataclass(frozen=True)
class AudioRef:
    """An audio file of the request (an ``input_audio`` part): which one, in
    prompt order, its base64 data, and the format the request says it is
    (``wav`` or ``mp3``; the bytes must be that)."""

    index: int
    data: str
    format: str

    def error(self, message: str, code: str) -> AudioRefusedError:
        """An :class:`~.failures.AudioRefusedError` for this audio file."""
        return AudioRefusedError(message, index=self.index, code=code)


#: Decodes (and, where allowed, fetches) a request's videos, in order, off
#: the event loop; raises :class:`~.failures.VideoRefusedError` for the first
#: it cannot use.
LoadVideos = Callable[[Sequence[VideoRef]], Awaitable[list[Video]]]

#: Decodes an audio file's bytes to mono samples at a sample rate, off the
#: event loop; raises :class:`~.failures.AudioRefusedError` when it cannot.
LoadAudio = Callable[[bytes, int], Awaitable[Audio]]

#: Decodes a request's audio parts, in order, to mono samples as a model
#: takes them (its rate, its longest file), off the event loop; raises
#: :class:`~.failures.AudioRefusedError` for the first it cannot use.
LoadAudios = Callable[[Sequence[AudioRef], AudioInput], Awaitable[list[Audio]]]


@dataclass(frozen=True)
class Decoders:
    """How a request's media is decoded off the event loop, under the
    server's limits (``app.py`` makes them).

    Attributes:
        images: A request's images.
        videos: Its videos.
        audios: Its audio parts, as the model takes audio.
        audio: An uploaded audio file, at a sample rate.
    """

    images: LoadImages
    videos: LoadVideos
    audios: LoadAudios
    audio: LoadAudio
