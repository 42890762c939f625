"""Real-time factor of ``POST /v1/audio/speech`` against mlx-audio's own
generation in process, on the same model and text, in one run.

Starts mlx-pinned's server on a free loopback port on the tiny Qwen3-TTS of
``mlx_pinned.testing`` (or ``--model FOLDER``), and loads the same model in
this process with mlx-audio's loader. For each of ``--requests`` rounds it
speaks ``--text`` (``--repeat`` times over) four ways: mlx-audio's
``generate`` whole and streamed (in process, the frame limit the server
would use), and the server's whole answer and its streamed one (``pcm``),
the four in turn each round.
The real-time factor is seconds of work per second of audio (below 1:
faster than real time); per way it prints the median RTF, the median time
to the first audio byte of the streamed ways, and each server way's RTF as
a ratio to mlx-audio's own (1.0: the server adds nothing), and writes the
figures as JSON (``--json``)::

    python benchmarks/speech.py [--requests 5] [--repeat 2] [--model FOLDER]
        [--json OUT]

It needs ``httpx`` beside mlx-pinned. Run it on a quiet machine; the
figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import free_port, server, wait_for

TEXT = "The model runs on one thread that owns its stream. "
VOICE = "vivian"
BYTES_PER_SAMPLE = 2
WAYS = ("mlx_audio_whole", "mlx_audio_streamed", "server_whole", "server_streamed")


class InProcess:
    """mlx-audio's own ``generate`` on the model, loaded in this process,
    called as the server calls it (the same frame limit and piece size)."""

    def __init__(self, folder: str, text: str) -> None:
        from mlx_audio.tts.utils import load_model

        from mlx_pinned.server.kinds.speech.engine import frame_limit

        self.model = load_model(Path(folder))
        settings = self.model.generate_config or {}
        self.limit = frame_limit(text, settings.get("max_new_tokens", 2048))
        self.text = text

    def once(self, stream: bool) -> tuple[float, float, float]:
        """One generation: its RTF, its first audio's time, its seconds."""
        import numpy as np

        from mlx_pinned.server.kinds.speech.engine import CHUNK_FRAMES, FRAME_RATE

        start = time.perf_counter()
        first = None
        samples = 0
        for result in self.model.generate(
            self.text,
            voice=VOICE,
            max_tokens=self.limit,
            stream=stream,
            streaming_interval=CHUNK_FRAMES / FRAME_RATE,
        ):
            samples += int(np.array(result.audio).size)
            first = first or time.perf_counter() - start
        took = time.perf_counter() - start
        seconds = samples / self.model.sample_rate
        return took / seconds, first or took, seconds


async def through_server(
    client: httpx.AsyncClient, name: str, text: str, stream: bool, rate: int
) -> tuple[float, float, float]:
    """One answer of the server, whole or streamed (``pcm``): its RTF, its
    first audio byte's time, its seconds."""
    body = {"model": name, "voice": VOICE, "input": text, "response_format": "pcm"}
    if stream:
        body["stream_format"] = "audio"
    start = time.perf_counter()
    first = None
    size = 0
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        async for piece in response.aiter_bytes():
            size += len(piece)
            first = first or time.perf_counter() - start
    took = time.perf_counter() - start
    seconds = size / BYTES_PER_SAMPLE / rate
    return took / seconds, first or took, seconds


@contextlib.contextmanager
def own_server(folder: str) -> Iterator[tuple[str, str, Any]]:
    """mlx-pinned serving ``folder`` as ``tts``: its URL, the name and its
    process."""
    port = free_port()
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", folder]
    command += ["--model-kind", "speech", "--served-model-name", "tts"]
    command += ["--port", str(port)]
    log = Path(tempfile.mkdtemp()) / "server.log"
    with server(command, log) as process:
        yield f"http://127.0.0.1:{port}", "tts", process


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from mlx_pinned.testing import tiny_speech_path

    folder = args.model or str(tiny_speech_path())
    text = TEXT * args.repeat
    own = InProcess(folder, text)
    rows: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    with own_server(folder) as (url, name, process):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            await wait_for(client, process, "/health", 120)
            rate = own.model.sample_rate
            # Warm-ups (MLX compiles its kernels on a first call), then the
            # four ways in turn each round, so a busy machine's noise falls
            # on all of them alike.
            own.once(True)
            await through_server(client, name, text, True, rate)
            for _ in range(args.requests):
                rows["mlx_audio_whole"].append(own.once(False))
                rows["mlx_audio_streamed"].append(own.once(True))
                rows["server_whole"].append(
                    await through_server(client, name, text, False, rate)
                )
                rows["server_streamed"].append(
                    await through_server(client, name, text, True, rate)
                )
    summary: dict[str, Any] = {}
    for way, runs in rows.items():
        summary[way] = {
            "rtf": statistics.median(run[0] for run in runs),
            "first_audio_seconds": statistics.median(run[1] for run in runs),
            "audio_seconds": runs[0][2],
            "runs": runs,
        }
    for server_way, own_way in (
        ("server_whole", "mlx_audio_whole"),
        ("server_streamed", "mlx_audio_streamed"),
    ):
        ratio = summary[server_way]["rtf"] / summary[own_way]["rtf"]
        summary[server_way]["ratio_to_mlx_audio"] = ratio
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5, help="rounds per way")
    parser.add_argument("--repeat", type=int, default=2, help="times over the text")
    parser.add_argument("--model", help="a text-to-speech model folder")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    print("way                  audio s   RTF    first audio ms  vs mlx-audio")
    for way, row in summary.items():
        ratio = row.get("ratio_to_mlx_audio")
        print(
            f"{way:<19}  {row['audio_seconds']:>7.2f}  {row['rtf']:>5.3f}  "
            f"{row['first_audio_seconds'] * 1000:>14.1f}  "
            + (f"{ratio:>10.2f}x" if ratio is not None else "")
        )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
