"""Transcription's real-time factor: mlx-pinned's ``/v1/audio/transcriptions``
against mlx-audio's own ``generate`` in process, on the same model and file.

Writes a WAV of ``--seconds`` of a noisy tone, then, in one run:

- **mlx-audio**: ``model.generate(samples, temperature=T)`` on this
  process's thread, the whole file in one call (the library as a script
  uses it);
- **mlx-pinned**: ``mlx-pinned serve`` on a free loopback port with the
  model as a ``transcription`` kind, the file uploaded as OpenAI's SDK
  does (``--url``/``--name``: a server already running instead, such as
  mlx-vlm's own on the same folder).

Each is run ``--rounds`` times after one warm-up; it prints the median
seconds and the real-time factor (seconds of audio per second of work) of
each, and their ratio. ``--model``: a speech-to-text folder (default: the
tiny Whisper of ``mlx_pinned.testing``, whose text is random)::

    python benchmarks/transcription.py [--seconds 120] [--rounds 3]
        [--temperature 0.2] [--model FOLDER] [--url URL --name NAME]

The figures go to docs/benchmarks.md; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path

import httpx
import numpy as np
from _common import free_port, server, wait_for


def tone(seconds: float, rate: int = 16000) -> bytes:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((signal * 32767).astype("<i2").tobytes())
    return out.getvalue()


def library(model_path: str, audio: bytes, temperature: float, rounds: int) -> float:
    """Median seconds of mlx-audio's ``generate`` on the whole file."""
    import mlx.core as mx
    from mlx_audio.stt.utils import load_model

    import mlx_pinned.server.inputs.audio as decoder
    from mlx_pinned.server.config import AudioLimits

    model = load_model(model_path)
    limits = AudioLimits(max_bytes=len(audio), max_seconds=1e9)
    samples = decoder.decode_audio(audio, limits, sample_rate=16000).samples
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        model.generate(mx.array(samples), temperature=temperature)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def served(
    url: str, name: str, audio: bytes, temperature: float, rounds: int
) -> float:
    """Median seconds of one upload to ``url``'s transcription route."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            answer = await client.post(
                "/v1/audio/transcriptions",
                data={"model": name, "temperature": str(temperature)},
                files={"file": ("tone.wav", audio, "audio/wav")},
            )
            answer.raise_for_status()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--model")
    parser.add_argument("--url")
    parser.add_argument("--name", default="whisper")
    args = parser.parse_args()
    if args.model is None:
        from mlx_pinned.testing import tiny_transcription_path

        args.model = str(tiny_transcription_path())
    audio = tone(args.seconds)
    alone = library(args.model, audio, args.temperature, args.rounds)
    if args.url:
        through = asyncio.run(
            served(args.url, args.name, audio, args.temperature, args.rounds)
        )
    else:
        port = free_port()
        command = [
            sys.executable, "-m", "mlx_pinned.server", "serve", args.model,
            "--model-kind", "transcription", "--served-model-name", args.name,
            "--port", str(port), "--max-audio-seconds", str(args.seconds + 1),
        ]  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as folder:
            log = Path(folder) / "server.log"
            with server(command, log) as process:

                async def run() -> float:
                    async with httpx.AsyncClient(base_url=url) as client:
                        await wait_for(client, process, "/health", 120)
                    return await served(
                        url, args.name, audio, args.temperature, args.rounds
                    )

                through = asyncio.run(run())
    for label, took in (("mlx-audio generate", alone), ("mlx-pinned", through)):
        factor = args.seconds / took
        print(f"{label:20s} {took:7.2f} s  real-time factor {factor:6.1f}x")
    print(f"mlx-pinned / mlx-audio speed: {alone / through:.2f}x")


if __name__ == "__main__":
    main()
