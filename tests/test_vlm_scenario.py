"""The bug report's scenario end to end, on a real (tiny) Qwen3-VL.

A vision-language model loaded on one thread and run from an async server's
worker threads fails with "There is no Stream"; through mlx-pinned it works.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from PIL import Image

from mlx_pinned import MLXThread, on_mlx_thread
from mlx_pinned.testing import make_test_image, make_tiny_vlm

MAX_TOKENS = 12
PROMPT = "Describe this image in one sentence."


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny")


def image(seed: int = 0) -> Image.Image:
    import io

    return Image.open(io.BytesIO(make_test_image(64, 64, seed=seed))).convert("RGB")


def load(path: Path, lazy: bool) -> tuple[Any, Any]:
    import mlx_vlm

    model, processor = mlx_vlm.load(str(path), lazy=lazy)
    return model, processor


def stream_tokens(model: Any, processor: Any, picture: Image.Image) -> Iterator[int]:
    import mlx_vlm

    prompt = mlx_vlm.apply_chat_template(processor, model.config, PROMPT, num_images=1)
    for result in mlx_vlm.stream_generate(
        model, processor, prompt, image=[picture], max_tokens=MAX_TOKENS
    ):
        if result.finish_reason is None:
            yield result.token


BASELINE = """
import asyncio, io, sys
import mlx_vlm
from PIL import Image
from mlx_pinned.testing import make_test_image

model, processor = mlx_vlm.load(sys.argv[1], lazy=True)
prompt = mlx_vlm.apply_chat_template(processor, model.config, sys.argv[2], num_images=1)
picture = Image.open(io.BytesIO(make_test_image())).convert("RGB")

def generate():
    return [r.token for r in mlx_vlm.stream_generate(
        model, processor, prompt, image=[picture], max_tokens=4)]

try:
    asyncio.run(asyncio.to_thread(generate))
except RuntimeError as exc:
    print("RuntimeError:", exc, flush=True)
else:
    print("generated", flush=True)
"""


@pytest.mark.slow
class TestBaseline:
    def test_lazy_load_then_worker_thread_fails(self, model_path: Path) -> None:
        # What servers did: load on the event loop's thread, generate in
        # asyncio.to_thread. MLX raises: the weights' stream is the loader's.
        # In a subprocess: a worker thread that used MLX and exits without
        # mx.clear_streams() can abort the interpreter at exit.
        import subprocess
        import sys

        done = subprocess.run(
            [sys.executable, "-c", BASELINE, str(model_path), PROMPT],
            capture_output=True,
            text=True,
            timeout=120,
        )
        first_line = done.stdout.splitlines()[0] if done.stdout else done.stderr
        assert re.match(
            r"RuntimeError: There is no Stream\(cpu, \d+\) in current thread",
            first_line,
        ), first_line


class TestPinned:
    @pytest.mark.slow
    @pytest.mark.parametrize("lazy", [False, True])
    def test_many_async_streams_and_plain_threads(
        self, model_path: Path, lazy: bool
    ) -> None:
        thread = MLXThread(name="vlm")

        @on_mlx_thread(thread=thread)
        def load_model() -> tuple[Any, Any]:
            return load(model_path, lazy=lazy)

        # The key keeps generations on the one model from interleaving
        # (mlx-vlm keeps request state on the model); without it the
        # SharedModelWarning says so.
        @on_mlx_thread(thread=thread, exclusive="vlm")
        def generate(model: Any, processor: Any, picture: Image.Image) -> Iterator[int]:
            assert thread.is_current()
            yield from stream_tokens(model, processor, picture)

        with thread:
            model, processor = load_model.sync()
            results: dict[str, list[int]] = {}
            errors: list[BaseException] = []

            def plain_thread_caller(index: int) -> None:
                try:
                    tokens = list(generate.sync(model, processor, image(index)))
                    results[f"thread-{index}"] = tokens
                except BaseException as exc:  # collected, asserted below
                    errors.append(exc)

            async def async_caller(index: int) -> None:
                tokens = [t async for t in generate(model, processor, image(index))]
                results[f"task-{index}"] = tokens

            async def main() -> None:
                async with anyio.create_task_group() as tg:
                    for index in range(16):
                        tg.start_soon(async_caller, index)

            workers = [
                threading.Thread(target=plain_thread_caller, args=(i,))
                for i in range(4)
            ]
            for worker in workers:
                worker.start()
            anyio.run(main)
            for worker in workers:
                worker.join(60)
            stats = thread.statistics()
        assert errors == []
        assert len(results) == 20
        assert all(len(tokens) == MAX_TOKENS for tokens in results.values())
        assert stats.failed == 0
        assert stats.open_streams == 0

    def test_same_greedy_output_pinned_as_in_process(self, model_path: Path) -> None:
        model, processor = load(model_path, lazy=False)
        alone = list(stream_tokens(model, processor, image(3)))
        with MLXThread() as thread:
            pinned_model, pinned_processor = thread.run_sync(load, model_path, False)
            pinned = list(
                thread.iterate_sync(
                    stream_tokens, pinned_model, pinned_processor, image(3)
                )
            )
        assert pinned == alone
        assert len(alone) == MAX_TOKENS
