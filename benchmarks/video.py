"""A video request's time to first token and decode cost per frame, beside
an image request's, on the tiny model.

In process: a clip of ``--frames`` frames (``--size`` pixels square, MJPG
in AVI, written by OpenCV) is decoded as the server decodes it
(:func:`mlx_pinned.server.inputs.videos.decode_video`, sampling at
``--fps``) and a JPEG of the same size as the image decoder does; then one
request with each goes through the batch engine alone, and its time to
first token is taken as its consumer receives it. Medians of ``--rounds``.
A quiet machine, never CI.

::

    python benchmarks/video.py [--frames 32] [--size 224] [--fps 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio


def clip(frames: int, size: int, fps: float) -> bytes:
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "clip.avi")
        writer = cv2.VideoWriter(
            path, cv2.VideoWriter.fourcc(*"MJPG"), fps, (size, size)
        )
        for _ in range(frames):
            writer.write(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        writer.release()
        return Path(path).read_bytes()


def timed(fn: Any, rounds: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


async def first_token(engine: Any, params: Any, images: list[Any]) -> float:
    start = time.perf_counter()
    async with engine.stream(params, images) as stream:
        async for _ in stream:
            return time.perf_counter() - start
    raise RuntimeError("the stream ended without an event")


async def main_async(args: argparse.Namespace) -> None:
    from mlx_pinned import MLXThread
    from mlx_pinned.server.config import ImageLimits, VideoLimits
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.server.engine.model import load
    from mlx_pinned.server.events import GenerationParams
    from mlx_pinned.server.inputs.images import decode_image
    from mlx_pinned.server.media import ImageRef, VideoRef
    from mlx_pinned.testing import make_test_image, tiny_vlm_path

    video_uri = (
        "data:video/x-msvideo;base64,"
        + base64.b64encode(clip(args.frames, args.size, args.fps)).decode()
    )
    image_uri = (
        "data:image/png;base64,"
        + base64.b64encode(make_test_image(args.size, args.size, seed=0)).decode()
    )
    limits = VideoLimits(fps=args.fps, max_frames=args.frames)
    video_s, video = timed(
        lambda: decode_video(VideoRef(0, video_uri), limits), args.rounds
    )
    image_s, image = timed(
        lambda: decode_image(ImageRef(0, image_uri), ImageLimits()), args.rounds
    )

    def params(kind: str, **extra: Any) -> GenerationParams:
        content = [{"type": "text", "text": "Describe it."}, {"type": kind}]
        return GenerationParams(
            ({"role": "user", "content": content},), max_tokens=2, **extra
        )

    async with MLXThread(name="video-bench") as thread:
        loaded = await thread.run(load, tiny_vlm_path())
        engine = BatchEngine(loaded, thread)
        runs = {
            "image": (params("image_url"), [image]),
            "video": (params("video", videos=(video,)), []),
        }
        for request in runs.values():
            await first_token(engine, *request)  # warm-up
        ttft = {
            kind: statistics.median(
                [await first_token(engine, *request) for _ in range(args.rounds)]
            )
            for kind, request in runs.items()
        }
    frames = len(video.indices)
    print(
        f"{'request':>8} {'decode (ms)':>12} {'per frame (ms)':>15} {'TTFT (ms)':>10}"
    )
    print(
        f"{'image':>8} {image_s * 1e3:>12.2f} {image_s * 1e3:>15.2f} "
        f"{ttft['image'] * 1e3:>10.1f}"
    )
    print(
        f"{'video':>8} {video_s * 1e3:>12.2f} {video_s * 1e3 / frames:>15.2f} "
        f"{ttft['video'] * 1e3:>10.1f}   ({frames} frames kept of {args.frames})"
    )


def decode_video(*args: Any) -> Any:
    from mlx_pinned.server.inputs.videos import decode_video as decode

    return decode(*args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--fps", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    anyio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
