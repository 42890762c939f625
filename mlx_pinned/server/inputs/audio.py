"""Untrusted audio files (WAV, MP3, FLAC, Ogg Vorbis, told apart by their
first bytes) decoded to mono float32 samples at the model's rate with
miniaudio, each limit checked from the header before a sample is decoded.
The loaders run on the event loop and decode in a worker thread under the
decoders' bound.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from ..config import AudioLimits
from ..failures import AudioRefusedError
from ..media import Audio, AudioInput, AudioRef
from ._load import decoders

__all__ = ["FORMATS", "decode_audio", "decode_part", "load_audio", "load_audios"]

FORMATS = ("wav", "mp3", "flac", "ogg")


async def load_audio(data: bytes, sample_rate: int, *, limits: AudioLimits) -> Audio:
    """A :data:`~..media.LoadAudio`, once ``limits`` are given."""
    return await anyio.to_thread.run_sync(
        lambda: decode_audio(data, limits, sample_rate=sample_rate),
        limiter=decoders(),
    )


async def load_audios(
    refs: Sequence[AudioRef], taken: AudioInput, *, limits: AudioLimits
) -> list[Audio]:
    """A :data:`~..media.LoadAudios`, once ``limits`` are given; a file
    longer than the model hears is refused from its header too."""
    if not refs:
        return []
    longest = taken.max_seconds
    if longest is not None and longest < limits.max_seconds:
        limits = dataclasses.replace(limits, max_seconds=longest)
    rate = taken.sample_rate
    return await anyio.to_thread.run_sync(
        lambda: [decode_part(ref, limits, sample_rate=rate) for ref in refs],
        limiter=decoders(),
    )


def decode_part(ref: AudioRef, limits: AudioLimits, *, sample_rate: int) -> Audio:
    """Decode an ``input_audio`` part, whose base64 data must be a file of
    the format it names. Calling thread.

    Raises:
        AudioRefusedError: Not base64, not of its ``format``, or refused by
            :func:`decode_audio`.
    """
    payload = ref.data.encode("ascii", "replace")
    # Base64 grows data by 4/3: refuse before decoding anything.
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise ref.error(_too_large(len(payload) // 4 * 3, limits), "audio_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ref.error(
            "the data is not valid base64; send the file's bytes base64-encoded "
            "(no data: URI).",
            "invalid_base64",
        ) from None
    kind = _kind(data)
    if data and kind != ref.format:
        found = f"a {kind.upper()} file" if kind else "not an audio file"
        raise ref.error(
            f"the format is {ref.format!r} but the data is {found}; send the "
            "format the file is in.",
            "audio_format_mismatch",
        )
    return decode_audio(data, limits, sample_rate=sample_rate, index=ref.index)


def decode_audio(
    data: bytes, limits: AudioLimits, *, sample_rate: int, index: int = 0
) -> Audio:
    """Decode one audio file to mono float32 samples at ``sample_rate``, on
    the calling thread; ``index`` names it in the error.

    Raises:
        AudioRefusedError: Empty, over a limit, not a format taken, or not
            decodable; the message says which.
    """

    def refuse(message: str, code: str = "invalid_audio") -> AudioRefusedError:
        return AudioRefusedError(message, index=index, code=code)

    if not data:
        raise refuse("the file is empty; send a WAV, MP3, FLAC or Ogg Vorbis file.")
    if len(data) > limits.max_bytes:
        raise refuse(_too_large(len(data), limits), "audio_too_large")
    kind = _kind(data)
    if kind is None:
        raise refuse(
            "the file is not in a format this server decodes (WAV, MP3, FLAC or "
            "Ogg Vorbis)."
        )
    info = _info(kind, data)
    if info is None:
        raise refuse(f"the file's {kind.upper()} header cannot be read.")
    _check_header(info, limits, refuse)
    import miniaudio

    try:
        decoded = miniaudio.decode(
            data,
            output_format=miniaudio.SampleFormat.FLOAT32,
            nchannels=1,
            sample_rate=sample_rate,
        )
    except miniaudio.MiniaudioError:
        raise refuse(f"the {kind.upper()} data cannot be decoded.") from None
    samples = np.frombuffer(decoded.samples, dtype=np.float32).copy()
    seconds = len(samples) / sample_rate
    if not len(samples):
        raise refuse("the file holds no audio.")
    if seconds > limits.max_seconds:  # a header that said less
        raise refuse(_too_long(seconds, limits), "audio_too_long")
    if not np.isfinite(samples).all():
        raise refuse("the file decodes to samples that are not numbers.")
    digest = hashlib.sha256(samples.tobytes()).hexdigest()
    return Audio(samples, sample_rate, seconds, digest)


def _kind(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    # An ID3 tag, or an MPEG audio frame's sync word (11 bits set).
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] >= 0xE0):
        return "mp3"
    return None


def _info(kind: str, data: bytes) -> Any:
    import miniaudio

    read = {
        "wav": miniaudio.wav_get_info,
        "mp3": miniaudio.mp3_get_info,
        "flac": miniaudio.flac_get_info,
        "ogg": miniaudio.vorbis_get_info,
    }[kind]
    try:
        return read(data)
    except miniaudio.MiniaudioError:
        return None


def _check_header(info: Any, limits: AudioLimits, refuse: Any) -> None:
    rate, channels = int(info.sample_rate), int(info.nchannels)
    if not 1 <= channels <= limits.max_channels:
        raise refuse(
            f"the file has {channels} channels; this server takes 1 to "
            f"{limits.max_channels}."
        )
    if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
        raise refuse(
            f"the file's sample rate is {rate} Hz; this server takes "
            f"{limits.min_sample_rate} to {limits.max_sample_rate} Hz."
        )
    seconds = int(info.num_frames) / rate
    if seconds > limits.max_seconds:
        raise refuse(_too_long(seconds, limits), "audio_too_long")


def _too_large(size: int, limits: AudioLimits) -> str:
    return (
        f"the file has {size} bytes, more than this server's limit of "
        f"{limits.max_bytes}."
    )


def _too_long(seconds: float, limits: AudioLimits) -> str:
    # The limit may be the server's or the model's (what it hears).
    return (
        f"the file is {seconds:.1f} seconds long, more than the limit of "
        f"{limits.max_seconds:g} seconds."
    )
