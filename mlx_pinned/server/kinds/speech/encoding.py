"""The audio formats speech is answered in: ``pcm`` (the engine's samples),
``wav`` (the same after a RIFF header), and ``mp3``, ``flac`` and ``opus``
(in Ogg) encoded with libsndfile. Any thread (pure CPU). docs/speech.md
says which are streamed, and why."""

from __future__ import annotations

import io
import struct
from typing import Any, Final

__all__ = [
    "ENCODED",
    "MEDIA_TYPES",
    "STREAMED",
    "UNKNOWN_LENGTH",
    "StreamEncoder",
    "audio_head",
    "encoded",
]

#: The ``response_format`` values answered whole (the others are a 400).
ENCODED: Final = ("mp3", "opus", "flac", "wav", "pcm")

#: Those also answered as they are made (``stream_format``).
STREAMED: Final = ("wav", "pcm", "opus")

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
    """The whole answer of ``pcm`` (mono 16-bit samples) in ``response_format``;
    an encoder takes milliseconds a second of audio (a worker thread's job)."""
    if response_format in ("wav", "pcm"):
        return audio_head(response_format, sample_rate, len(pcm)) + pcm
    import numpy as np
    import soundfile

    container, codec = _SOUNDFILE[response_format]
    out = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    soundfile.write(out, samples, sample_rate, subtype=codec, format=container)
    return out.getvalue()


class StreamEncoder:
    """A streamed answer's bytes, piece by piece: the raw samples (``pcm``;
    ``wav`` after its header) or Opus in Ogg, each page as it fills. One
    thread at a time; an Opus piece takes milliseconds (:attr:`slow`: feed
    it in a worker thread). ``response_format`` is one of :data:`STREAMED`."""

    def __init__(self, response_format: str, sample_rate: int) -> None:
        self.response_format = response_format
        self.slow = response_format == "opus"
        self._head = audio_head(response_format, sample_rate, None)
        self._sink: _Sink | None = None
        self._file: Any = None
        if self.slow:
            import soundfile

            container, codec = _SOUNDFILE[response_format]
            self._sink = _Sink()
            self._file = soundfile.SoundFile(
                self._sink, "w", sample_rate, _CHANNELS, codec, format=container
            )

    def feed(self, pcm: bytes) -> bytes:
        """The bytes to send after ``pcm`` (maybe none: a page not full)."""
        if self._file is None:
            head, self._head = self._head, b""
            return head + pcm
        assert self._sink is not None
        self._file.buffer_write(pcm, dtype="int16")
        return self._sink.take()

    def end(self) -> bytes:
        """The last bytes (the encoder's last page), once every piece is in."""
        if self._file is None:
            head, self._head = self._head, b""
            return head
        assert self._sink is not None
        self._file.close()
        self._file = None
        return self._sink.take()

    def close(self) -> None:
        """Drop the encoder (a stream that ended early)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class _Sink(io.RawIOBase):
    """The file libsndfile encodes into: kept whole (it may seek back and
    read), handing out what was written past the last hand-out."""

    def __init__(self) -> None:
        super().__init__()
        self._data = bytearray()
        self._at = 0
        self._sent = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raw = bytes(data)
        end = self._at + len(raw)
        if end > len(self._data):
            self._data.extend(bytes(end - len(self._data)))
        self._data[self._at : end] = raw
        self._at = end
        return len(raw)

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else self._at + size
        raw = bytes(self._data[self._at : end])
        self._at += len(raw)
        return raw

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}
        self._at = base[whence] + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def take(self) -> bytes:
        """What was written since the last call."""
        raw = bytes(self._data[self._sent :])
        self._sent = len(self._data)
        return raw
