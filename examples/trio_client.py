"""trio tasks sharing one pinned MLX thread, including stopping a stream early.

Run::

    python examples/trio_client.py [--model PATH] [--tasks N] [--max-tokens N]

Without ``--model`` it uses the tiny random-weight model of
``mlx_pinned.testing`` (written to a cache folder on first use, offline).
Nothing here is trio-specific on the mlx-pinned side: the same code runs
under asyncio (``anyio.run(main)``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
from collections.abc import Iterator
from typing import Any

import trio
from PIL import Image

from mlx_pinned import MLXThread, on_mlx_thread
from mlx_pinned.testing import make_test_image, tiny_vlm_path

# mlx-vlm ships py.typed, but its annotations do not fit these calls (PIL
# images, chat messages): use it untyped.
mlx_vlm: Any = importlib.import_module("mlx_vlm")
PROMPT = "Describe this image in one sentence."

mlx_thread = MLXThread(name="trio-example")


@on_mlx_thread(thread=mlx_thread)
def load(path: str) -> tuple[Any, Any]:
    """Runs on the MLX thread; the trio task awaiting it is not blocked."""
    model, processor = mlx_vlm.load(path)
    return model, processor


# Qwen-VL models keep per-request state on the model object: generations on
# one model must not interleave. Streams that share an exclusive key take
# turns on the MLX thread, each holding the key until it ends or is closed.
@on_mlx_thread(thread=mlx_thread, exclusive="vlm")
def token_ids(
    model: Any, processor: Any, image: Image.Image, max_tokens: int
) -> Iterator[int]:
    """Runs on the MLX thread one token per turn."""
    prompt = mlx_vlm.apply_chat_template(processor, model.config, PROMPT, num_images=1)
    for result in mlx_vlm.stream_generate(
        model, processor, prompt, image=[image], max_tokens=max_tokens, temperature=0.0
    ):
        if result.finish_reason is None:  # the last result repeats a token
            yield result.token


def picture(seed: int) -> Image.Image:
    return Image.open(io.BytesIO(make_test_image(64, 64, seed=seed))).convert("RGB")


async def main(path: str, tasks: int, max_tokens: int) -> None:
    async with mlx_thread:  # started here; shut down on exit without blocking trio
        model, processor = await load(path)
        counts: dict[int, int] = {}

        async def generate(index: int) -> None:
            async with contextlib.aclosing(
                token_ids(model, processor, picture(index), max_tokens)
            ) as stream:
                counts[index] = len([token async for token in stream])

        async with trio.open_nursery() as nursery:
            for index in range(tasks):
                nursery.start_soon(generate, index)

        # Stop a long stream after 3 tokens: leaving the aclosing block closes
        # the generator on the MLX thread before it makes another token.
        taken = 0
        async with contextlib.aclosing(
            token_ids(model, processor, picture(0), 10_000)
        ) as stream:
            async for _ in stream:
                taken += 1
                if taken == 3:
                    break
        stats = mlx_thread.statistics()

    for index in sorted(counts):
        print(f"task {index}: {counts[index]} tokens")
    print(f"stopped early after {taken} tokens")
    print(
        f"MLX thread: {stats.completed} completed, {stats.cancelled} cancelled,"
        f" {stats.failed} failed, {stats.open_streams} streams open"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description="trio tasks, one MLX thread.")
    parser.add_argument("--model", help="model folder (default: the tiny model)")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    path = args.model or str(tiny_vlm_path())
    trio.run(main, path, args.tasks, args.max_tokens)


if __name__ == "__main__":
    cli()
