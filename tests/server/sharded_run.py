"""One rank of test_shard.py's ``mlx.launch`` run (not a test module).

On its MLX thread: joins the ring group and sums a number over it, then, for
each tiny family, generates greedily with the whole model and with its shard
through the batch engine (two requests together, one with an image), and
writes the tokens and log-probabilities to ``OUT/rank<N>.json``.
"""

from __future__ import annotations

import functools
import io
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from PIL import Image

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine
from mlx_pinned.server.engine.model import load
from mlx_pinned.server.engine.shard import shard
from mlx_pinned.server.events import GenerationParams, SamplingParams, TokenEvent
from mlx_pinned.testing import make_test_image, tiny_lm_path, tiny_vlm_path

sys.path.insert(0, str(Path(__file__).parent))
from inline import generate_inline


def request(text: str, image: bool) -> GenerationParams:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image_url"})
    return GenerationParams(
        ({"role": "user", "content": content},),
        max_tokens=16,
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
    )


def generate(engine: BatchEngine, image: bool) -> list[list[Any]]:
    """Two requests decoded together; each token's text and logprob."""
    picture = Image.open(io.BytesIO(make_test_image(64, 48, seed=3))).convert("RGB")
    streams = [
        generate_inline(engine, request("describe it", image), [picture] * image),
        generate_inline(engine, request("and now a longer question", False), []),
    ]
    found: list[list[Any]] = [[], []]
    open_streams = set(range(2))
    while open_streams:  # one token of each in turn: they share steps
        for index in sorted(open_streams):
            event = next(streams[index], None)
            if event is None:
                open_streams.discard(index)
            elif isinstance(event, TokenEvent) and event.logprobs is not None:
                found[index].append([event.logprobs.token, event.logprobs.logprob])
    return found


def run(out: Path) -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    rank = group.rank()
    total = mx.distributed.all_sum(mx.array([rank + 1.0]), group=group)
    result: dict[str, Any] = {"size": group.size(), "sum": total.item()}
    families = {"qwen3_vl": (tiny_vlm_path(), True), "qwen3": (tiny_lm_path(), False)}
    for family, (path, image) in families.items():
        whole = BatchEngine(load(path), thread)
        part = BatchEngine(
            load(path, shard=functools.partial(shard, group=group)), thread
        )
        result[family] = {
            "whole": generate(whole, image),
            "sharded": generate(part, image),
            "parameters": [whole.loaded.parameters, part.loaded.parameters],
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    thread = MLXThread(name="sharded-run")
    with thread:
        thread.run_sync(run, Path(sys.argv[1]))
