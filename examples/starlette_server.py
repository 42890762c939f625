"""A custom Starlette vision endpoint with the model pinned to one MLX thread.

Run::

    python examples/starlette_server.py --port 8000 [--model PATH]

Without ``--model`` it serves the tiny random-weight model of
``mlx_pinned.testing`` (written to a cache folder on first use, offline).

``POST /describe`` takes ``{"prompt": str, "image": base64 str, "max_tokens":
int}`` and streams newline-delimited JSON: one ``{"token", "text"}`` line per
generated token, then ``{"done": true, "finish_reason", "tokens", "text"}``.
For example::

    IMAGE=$(python -c "import base64; from mlx_pinned.testing import \\
        make_test_image; print(base64.b64encode(make_test_image()).decode())")
    curl -N localhost:8000/describe \\
        -d "{\\"prompt\\": \\"Describe this image.\\", \\"image\\": \\"$IMAGE\\"}"

Which thread runs what: the model load and every generator step run on the
MLX thread; image decoding runs on an anyio worker thread (it touches no MLX);
the event loop only moves bytes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import importlib
import io
import json
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_pinned import MLXThread, on_mlx_thread
from mlx_pinned.middleware import MLXThreadMiddleware
from mlx_pinned.testing import tiny_vlm_path

# mlx-vlm ships py.typed, but its annotations do not fit these calls (PIL
# images, chat messages): use it untyped.
mlx_vlm: Any = importlib.import_module("mlx_vlm")

# One thread loads the model and runs every generation: MLX streams are
# thread-local. The middleware starts it with the app and stops it last.
# Past max_pending queued jobs and streams, a request gets 503 at once.
mlx_thread = MLXThread(name="vision", max_pending=64)


def load_model(path: str) -> tuple[Any, Any]:
    """Run by the middleware on the MLX thread at start-up."""
    model, processor = mlx_vlm.load(path)
    return model, processor


# Qwen-VL models keep per-request state on the model object, so generations
# on one model must not interleave: streams that share an exclusive key take
# turns on the MLX thread (mlx_pinned.server batches them instead).
@on_mlx_thread(thread=mlx_thread, exclusive="vlm")
def generate(
    model: Any, processor: Any, prompt: str, image: Image.Image, max_tokens: int
) -> Iterator[dict[str, Any]]:
    """Stream one generation. Runs on the MLX thread one token per turn; if
    the client goes away, it is closed there before its next token."""
    chat = mlx_vlm.apply_chat_template(processor, model.config, prompt, num_images=1)
    count = 0
    for result in mlx_vlm.stream_generate(
        model, processor, chat, image=[image], max_tokens=max_tokens, temperature=0.0
    ):
        if result.finish_reason is None:
            count += 1
            yield {"token": result.token, "text": result.text}
        else:  # the last result repeats the last token and flushes the text
            yield {
                "done": True,
                "finish_reason": result.finish_reason,
                "tokens": count,
                "text": result.text,
            }


def decode_image(data: str) -> Image.Image:
    """Base64 to RGB pixels, on a worker thread (never on the MLX thread)."""
    image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
    return image.convert("RGB")


async def describe(request: Request) -> Response:
    try:
        body = await request.json()
        prompt = str(body["prompt"])
        max_tokens = int(body.get("max_tokens", 32))
        image = await anyio.to_thread.run_sync(decode_image, body["image"])
    except (KeyError, TypeError, ValueError, OSError) as exc:
        return JSONResponse({"error": f"bad request: {exc!r}"}, status_code=400)
    if not 1 <= max_tokens <= 512:
        return JSONResponse({"error": "max_tokens: 1 to 512"}, status_code=400)
    model, processor = request.state.model
    # Created here, before the response starts: a full queue raises
    # MLXThreadBusyError now, and the middleware answers 503.
    pieces = generate(model, processor, prompt, image, max_tokens)

    async def lines() -> AsyncIterator[bytes]:
        # aclosing: a client that goes away closes the generator on the MLX
        # thread, which frees the key for the next request.
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                yield json.dumps(piece).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def health(request: Request) -> JSONResponse:
    stats = request.state.mlx_thread.statistics()
    return JSONResponse({"pending": stats.pending, "completed": stats.completed})


def create_app(model_path: str) -> Starlette:
    return Starlette(
        routes=[
            Route("/describe", describe, methods=["POST"]),
            Route("/health", health),
        ],
        middleware=[
            Middleware(
                MLXThreadMiddleware,
                thread=mlx_thread,
                # Loaded on the MLX thread before the server accepts requests;
                # then request.state.model.
                startup={"model": functools.partial(load_model, model_path)},
            )
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="A vision endpoint on Starlette.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", help="model folder (default: the tiny model)")
    args = parser.parse_args()
    app = create_app(args.model or str(tiny_vlm_path()))
    # On SIGTERM uvicorn shuts down gracefully (lifespan included, so the MLX
    # thread is stopped), restores this handler and raises the signal again.
    # Exit 0 then, not "killed by SIGTERM".
    signal.signal(signal.SIGTERM, _exit_zero)
    uvicorn.run(app, host=args.host, port=args.port)


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    main()
