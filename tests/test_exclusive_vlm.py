"""Exclusive keys on a real (tiny) Qwen3-VL: why they exist, and that they work.

mlx-vlm's Qwen-VL language models keep request state on the model object
(``_rope_deltas``, ``_position_ids``). Two generations interleaved item by
item on one MLX thread read each other's state: with images of 32 and 128
pixels, the smaller one's tokens change. Given the model as their exclusive
key they do not interleave, and each gives exactly its solo tokens and
per-token log-probabilities, while unkeyed work still runs between items.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
from PIL import Image

from mlx_pinned import MLXThread, SharedModelWarning
from mlx_pinned.testing import make_test_image, make_tiny_vlm

MAX_TOKENS = 10
PROMPT = "Describe this image in one sentence."
SIZES = (32, 128)  # FACTS.md: interleaving these changes the 32 px tokens
TOLERANCE = 1e-5

Generated = list[tuple[int, float]]  # (token id, its log-probability) per step


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny")


def picture(size: int) -> Image.Image:
    data = make_test_image(size, size, seed=size)
    return Image.open(io.BytesIO(data)).convert("RGB")


def load(path: Path) -> tuple[Any, Any]:
    from mlx_vlm.utils import load as load_model

    model, processor = load_model(str(path))
    return model, processor


def generate(model: Any, processor: Any, size: int) -> Iterator[tuple[int, float]]:
    """One greedy generation: each token with its log-probability."""
    from mlx_vlm.prompt_utils import apply_chat_template

    # `from mlx_vlm import generate` is the function; this is the module.
    generation = importlib.import_module("mlx_vlm.generate")
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    for result in generation.stream_generate(
        model, processor, prompt, image=[picture(size)], max_tokens=MAX_TOKENS
    ):
        if result.finish_reason is None:
            yield result.token, result.logprobs[result.token].item()


def generate_all(model: Any, processor: Any, size: int) -> Generated:
    """A whole generation as one plain job."""
    return list(generate(model, processor, size))


def unrelated() -> float:
    """Work that touches no model: it may run between any two items."""
    total: float = (mx.arange(64) * 2).sum().item()  # type: ignore[assignment]
    return total


def differences(got: Generated, solo: Generated) -> tuple[bool, float]:
    """Whether the token ids match, and the largest log-probability gap."""
    same_ids = [token for token, _ in got] == [token for token, _ in solo]
    gap = max(abs(a - b) for (_, a), (_, b) in zip(got, solo, strict=True))
    return same_ids, gap


async def interleaved(
    mlx_thread: MLXThread, model: Any, processor: Any, key: object
) -> tuple[dict[str, Generated], int]:
    """Both sizes as streams and the small one as a plain job too, all at
    once, with ``key`` (``None``: none); also unkeyed jobs meanwhile. Returns
    the generations and how many unkeyed jobs finished while one was open."""
    runner = mlx_thread if key is None else mlx_thread.exclusive(key)
    results: dict[str, Generated] = {}
    open_streams = 0
    between = 0

    async def stream(size: int) -> None:
        nonlocal open_streams
        open_streams += 1
        try:
            results[f"stream {size}"] = [
                item async for item in runner.iterate(generate, model, processor, size)
            ]
        finally:
            open_streams -= 1

    async def job(size: int) -> None:
        results[f"job {size}"] = await runner.run(generate_all, model, processor, size)

    async def unkeyed() -> None:
        nonlocal between
        while not results or open_streams:
            await mlx_thread.run(unrelated)
            between += bool(open_streams)
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tasks:
        for size in SIZES:
            tasks.start_soon(stream, size)
        tasks.start_soon(job, SIZES[0])
        tasks.start_soon(unkeyed)
    return results, between


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_interleaved_generations_need_the_model_as_their_key(
    model_path: Path,
) -> None:
    with MLXThread(name="vlm-exclusive") as mlx_thread:
        model, processor = await mlx_thread.run(load, model_path)
        solo = {
            size: await mlx_thread.run(generate_all, model, processor, size)
            for size in SIZES
        }
        assert all(len(tokens) == MAX_TOKENS for tokens in solo.values())

        # The safety net sees the two streams share the model without a key.
        with pytest.warns(SharedModelWarning, match="exclusive=model"):
            unkeyed, _ = await interleaved(mlx_thread, model, processor, None)
        # Without a key a generation reads the rope state another one left on
        # the model: its tokens, or at least its log-probabilities, move.
        moved = {
            name: differences(generated, solo[int(name.split()[-1])])
            for name, generated in unkeyed.items()
        }
        print("without a key (same ids, largest logprob gap):", moved)
        assert any(not same or gap > 1e-3 for same, gap in moved.values()), moved

        keyed, between = await interleaved(mlx_thread, model, processor, model)
        exact = {
            name: differences(generated, solo[int(name.split()[-1])])
            for name, generated in keyed.items()
        }
        print("with the model as key:", exact, "unkeyed jobs between:", between)
        for name, (same_ids, gap) in exact.items():
            assert same_ids, name
            assert gap <= TOLERANCE, (name, gap)
        assert between > 0  # unkeyed work ran while a keyed stream was open
        assert mlx_thread.statistics().waiting_for_key == ()
