"""The audio formats this server answers speech in.

Any thread (pure CPU). ``pcm`` is the engine's samples as they are: mono,
16-bit little-endian, at the model's rate (24 kHz for Qwen3-TTS, as
OpenAI's ``pcm``). ``wav`` is the same samples after a 44-byte RIFF header;
a streamed one cannot know its length, so its header says the largest
sizes (``0xFFFFFFFF``), as streamed WAV commonly does, and readers read
to the end of the body. ``mp3``, ``flac`` and ``opus`` (in Ogg) are
encoded whole, once the speech is made, with libsndfile (the
``soundfile`` package): a streamed FLAC or MP3 would lack the totals its
header is patched with at the end, which libsndfile's own reader then
misreads, so those formats are not streamed. ``aac`` has no encoder here.
"""

from __future__ import annotations

import io
import struct
from typing import Final

__all__ = [
    "ENCODED",
    "MEDIA_TYPES",
    "STREAMED",
    "UNKNOWN_LENGTH",
    "audio_head",
    "encoded",
]

#: The ``response_format`` values answered whole (the others are a 400).
ENCODED: Final = ("mp3", "opus", "flac", "wav", "pcm")

#: Those also answered as they are made (``stream_format``).
STREAMED: Final = ("wav", "pcm")

#: Each format's ``content-type``.
MEDIA_TYPES: Final = {
    "mp3": b"audio/mpeg",
    "opus": b"audio/ogg",
    "flac": b"audio/flac",
    "wav": b"audio/wav",
    "pcm": b"audio/pcm",
}

#: What a streamed WAV's header says of its sizes.
UNKNOWN_LENGTH: Final = 0xFFFFFFFF

_CHANNELS: Final = 1
_SAMPLE_BYTES: Final = 2

# libsndfile's container and codec of each encoded format.
_SOUNDFILE: Final = {
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
    "flac": ("FLAC", "PCM_16"),
}


def audio_head(response_format: str, sample_rate: int, data: int | None) -> bytes:
    """What goes before the samples of a ``wav`` or ``pcm`` answer: nothing
    for ``pcm``, the RIFF header for ``wav`` (``data``: bytes of samples
    after it; None: not known yet, a stream)."""
    if response_format == "pcm":
        return b""
    frame = _CHANNELS * _SAMPLE_BYTES
    riff = UNKNOWN_LENGTH if data is None else 36 + data
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        riff,
        b"WAVE",
        b"fmt ",
        16,  # the fmt chunk's size
        1,  # PCM
        _CHANNELS,
        sample_rate,
        sample_rate * frame,
        frame,
        8 * _SAMPLE_BYTES,
        b"data",
        UNKNOWN_LENGTH if data is None else data,
    )


def encoded(response_format: str, pcm: bytes, sample_rate: int) -> bytes:
    """The whole answer of ``pcm`` (mono 16-bit samples) in
    ``response_format``. Run it in a worker thread for a long speech: an
    encoder takes milliseconds a second of audio."""
    if response_format in STREAMED:
        return audio_head(response_format, sample_rate, len(pcm)) + pcm
    import numpy as np
    import soundfile

    container, codec = _SOUNDFILE[response_format]
    out = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    soundfile.write(out, samples, sample_rate, subtype=codec, format=container)
    return out.getvalue()
