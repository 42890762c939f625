"""The audio formats this server answers speech in: ``wav`` and ``pcm``.

Any thread (pure CPU). ``pcm`` is the engine's samples as they are: mono,
16-bit little-endian, at the model's rate (24 kHz for Qwen3-TTS, as
OpenAI's ``pcm``). ``wav`` is the same samples after a 44-byte RIFF header;
a streamed one cannot know its length, so its header says the largest
sizes (``0xFFFFFFFF``), as streamed WAV commonly does, and readers read
to the end of the body.
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = ["ENCODED", "MEDIA_TYPES", "UNKNOWN_LENGTH", "audio_head"]

#: The ``response_format`` values answered (the others are a 400).
ENCODED: Final = ("wav", "pcm")

#: Each format's ``content-type``.
MEDIA_TYPES: Final = {"wav": b"audio/wav", "pcm": b"audio/pcm"}

#: What a streamed WAV's header says of its sizes.
UNKNOWN_LENGTH: Final = 0xFFFFFFFF

_CHANNELS: Final = 1
_SAMPLE_BYTES: Final = 2


def audio_head(response_format: str, sample_rate: int, data: int | None) -> bytes:
    """What goes before the samples: nothing for ``pcm``, the RIFF header
    for ``wav`` (``data``: bytes of samples after it; None: not known yet,
    a stream)."""
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
