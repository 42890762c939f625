"""Plain threads, no asyncio: a vision model pinned to one MLX thread.

Several ``threading.Thread`` workers call the model through ``.sync(...)``.
Each call is carried to the process-wide default MLX thread (the decorator
without ``thread=``), which loaded the model, so no "There is no Stream" error
can happen, whichever thread asks. Run::

    python examples/plain_threads.py [--model PATH] [--threads N] [--max-tokens N]

Without ``--model`` it uses the tiny random-weight model of
``mlx_pinned.testing`` (written to a cache folder on first use, offline). The
script never shuts the MLX thread down: mlx-pinned does that at exit, and the
process exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import io
import threading
from collections.abc import Iterator
from typing import Any

from PIL import Image

from mlx_pinned import current_default_mlx_thread, on_mlx_thread
from mlx_pinned.testing import make_test_image, tiny_vlm_path

# mlx-vlm ships py.typed, but its annotations do not fit these calls (PIL
# images, chat messages): use it untyped.
mlx_vlm: Any = importlib.import_module("mlx_vlm")
PROMPT = "Describe this image in one sentence."


@on_mlx_thread
def load(path: str) -> tuple[Any, Any]:
    """Load on the MLX thread: the weights' lazy arrays belong to its stream."""
    model, processor = mlx_vlm.load(path)
    return model, processor


def _token_ids(
    model: Any, processor: Any, image: Image.Image, max_tokens: int
) -> Iterator[int]:
    """Greedy generation with mlx-vlm; called only on the MLX thread."""
    prompt = mlx_vlm.apply_chat_template(processor, model.config, PROMPT, num_images=1)
    for result in mlx_vlm.stream_generate(
        model, processor, prompt, image=[image], max_tokens=max_tokens, temperature=0.0
    ):
        if result.finish_reason is None:  # the last result repeats a token
            yield result.token


# Qwen-VL models keep per-request state on the model object, so two
# generations on one model must not interleave on the MLX thread: calls that
# share an exclusive key take turns there (no lock on the callers' side).
@on_mlx_thread(exclusive="vlm")
def generate_ids(
    model: Any, processor: Any, image: Image.Image, max_tokens: int
) -> list[int]:
    """A whole generation as one job on the MLX thread: its token ids."""
    return list(_token_ids(model, processor, image, max_tokens))


@on_mlx_thread(exclusive="vlm")
def stream_ids(
    model: Any, processor: Any, image: Image.Image, max_tokens: int
) -> Iterator[int]:
    """The same generation as a stream, produced on the MLX thread one token per
    turn and consumed on the caller's thread."""
    yield from _token_ids(model, processor, image, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description="Plain threads, one MLX thread.")
    parser.add_argument("--model", help="model folder (default: the tiny model)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    path = args.model or str(tiny_vlm_path())

    model, processor = load.sync(path)  # blocks this (main) thread until loaded
    lines: list[str] = []

    def worker(index: int) -> None:
        # Image decoding touches no MLX: it stays on this plain thread.
        image = Image.open(io.BytesIO(make_test_image(64, 64, seed=index)))
        ids = generate_ids.sync(model, processor, image, args.max_tokens)
        # A with block closes the generator on the MLX thread even if this
        # loop stops early (and so frees the key for the next caller).
        with stream_ids.sync(model, processor, image, args.max_tokens) as stream:
            streamed = list(stream)
        lines.append(
            f"worker {index}: job {len(ids)} tokens, stream {len(streamed)} tokens,"
            f" same ids: {ids == streamed}"
        )

    workers = [
        threading.Thread(target=worker, args=(index,), name=f"worker-{index}")
        for index in range(args.threads)
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()

    for line in sorted(lines):
        print(line)
    if len(lines) != len(workers):
        raise SystemExit(f"{len(workers) - len(lines)} workers failed (see above)")
    stats = current_default_mlx_thread().statistics()
    print(f"MLX thread: {stats.completed} jobs completed, {stats.failed} failed")


if __name__ == "__main__":
    main()
