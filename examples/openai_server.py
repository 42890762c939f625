"""A small OpenAI-compatible chat server: one model pinned to one MLX thread.

Run::

    python examples/openai_server.py [--model PATH] [--host HOST] [--port PORT]

Without ``--model`` it serves the tiny random-weight model of
``mlx_pinned.testing`` as ``mlx-pinned-demo`` (written offline to a cache
folder on first use); with it, the model is served under the name given.

``POST /v1/chat/completions`` takes text and images (``data:`` URLs),
answers whole or streamed (server-sent events, then ``data: [DONE]``), with
``usage`` and ``finish_reason``; ``GET /v1/models`` lists the model. A field
outside ``FIELDS`` is a 400 that names it. Errors have OpenAI's shape: 400
names the field at fault, 404 an unknown model, 503 with ``Retry-After``
when the MLX thread's queue is full. ``mlx-pinned serve`` is the full server
built from the same pieces.

Which thread runs what: the model load, the chat template and every
generation step run on the MLX thread; image decoding runs on an anyio worker
thread (it touches no MLX); the event loop parses, checks and moves bytes.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import functools
import importlib
import io
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import mlx_pinned
from mlx_pinned.testing import tiny_vlm_path

# mlx-vlm's annotations do not fit these calls (PIL images, chat messages).
mlx_vlm: Any = importlib.import_module("mlx_vlm")
mx: Any = importlib.import_module("mlx.core")

DEMO_NAME = "mlx-pinned-demo"
FIELDS = (
    "max_completion_tokens max_tokens messages model seed stop stream"
    " stream_options temperature top_p"
).split()
ROLES = ("system", "user", "assistant")
MAX_TOKENS = 4096
MAX_IMAGE_BYTES = 20 * 1024 * 1024

# One thread loads the model and runs every generation: MLX streams are
# thread-local. The lifespan starts it and stops it last. Past max_pending
# queued jobs and streams, a request gets 503 at once.
mlx_thread = mlx_pinned.MLXThread(name="openai", max_pending=64)
logger = logging.getLogger("openai_server")
BusyError, ClosedError = mlx_pinned.MLXThreadBusyError, mlx_pinned.MLXThreadClosedError
BrokenError = mlx_pinned.MLXThreadBrokenError


class APIError(Exception):
    """An answer in OpenAI's error shape, raised anywhere in a request."""

    def __init__(self, status: int, message: str, param: Any = None, code: Any = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


def openai_error(exc: Exception) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The status, OpenAI's ``{"error": {...}}`` body and the headers."""
    headers = {}
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, BusyError):
        error = APIError(503, str(exc), code="server_busy")
        headers["Retry-After"] = "1"
    elif isinstance(exc, (ClosedError, BrokenError)):
        error = APIError(503, "The server is shutting down.", code="unavailable")
    elif isinstance(exc, HTTPException):
        error = APIError(exc.status_code, str(exc.detail))
    else:  # the details stay in the server's log
        error = APIError(500, "The server had an error processing your request.")
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    body = {"message": error.message, "type": kind}
    body |= {"param": error.param, "code": error.code}
    return error.status, {"error": body}, headers


def error_response(request: Request, exc: Exception) -> Response:
    status, body, headers = openai_error(exc)
    return JSONResponse(body, status, headers)


@dataclass
class Chat:
    """A checked request: what the MLX thread needs, and how to answer."""

    messages: list[dict[str, Any]]
    images: list[tuple[str, str]]  # (data: URL, field), decoded on a worker
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def ranged(body: dict[str, Any], name: str, low: float, high: float) -> Any:
    """``body[name]``, a number from ``low`` to ``high`` (integer if both
    bounds are), or None if absent."""
    value, kinds = body.get(name), int if isinstance(low + high, int) else (int, float)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad(name, f"must be {'an integer' if kinds is int else 'a number'}.")
    if not low <= value <= high:
        raise bad(name, f"must be from {low} to {high}.")
    return value


def content_parts(content: Any, where: str, role: str) -> tuple[Any, list[Any]]:
    """A message's content for the chat template, and its images' URLs."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not content:
        raise bad(where, "must be a string or a non-empty list of parts.")
    parts: list[dict[str, str]] = []
    images = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str) and len(part) == 2:
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and role == "user" and len(part) == 2:
            image = part.get("image_url")
            if not isinstance(image, dict) or set(image) != {"url"}:
                raise bad(f"{at}.image_url", 'must be {"url": "data:..."}.')
            if not str(image["url"]).startswith("data:"):
                raise bad(f"{at}.image_url.url", "this server takes data: URLs only.")
            parts.append({"type": "image"})
            images.append((image["url"], f"{at}.image_url.url"))
        else:
            raise bad(at, f"unsupported content part for role {role!r}.")
    return parts, images


def parse(body: Any, served: str) -> Chat:
    """Check the body against the fields this server supports."""
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object.")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        names = ", ".join(map(repr, unknown))
        message = f"Unsupported parameter(s): {names}; supported: {', '.join(FIELDS)}."
        raise APIError(400, message, unknown[0], "unsupported_parameter")
    if not isinstance(body.get("model"), str):
        raise bad("model", "must be a string.")
    if body["model"] != served:
        message = f"The model {body['model']!r} does not exist."
        raise APIError(404, message, "model", "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list.")
    chat = Chat(messages=[], images=[])
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "must be an object.")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            where = f"messages[{i}].{extra[0]}"
            raise bad(where, "is not supported.", "unsupported_parameter")
        if message.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}.")
        role = message["role"]
        content, images = content_parts(
            message.get("content"), f"messages[{i}].content", role
        )
        chat.messages.append({"role": role, "content": content})
        chat.images += images
    tokens = ranged(body, "max_completion_tokens", 1, MAX_TOKENS)
    chat.max_tokens = tokens or ranged(body, "max_tokens", 1, MAX_TOKENS) or 256
    temperature = ranged(body, "temperature", 0.0, 2.0)
    chat.temperature = 1.0 if temperature is None else temperature
    chat.top_p = ranged(body, "top_p", 1e-9, 1.0) or 1.0
    chat.seed = ranged(body, "seed", -(2**63), 2**64 - 1)
    stop = body.get("stop")
    chat.stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(chat.stop, list) or len(chat.stop) > 4:
        raise bad("stop", "must be a string or a list of up to 4 strings.")
    if not all(isinstance(s, str) and s for s in chat.stop):
        raise bad("stop", "must hold non-empty strings.")
    chat.stream = body.get("stream") or False
    if not isinstance(chat.stream, bool):
        raise bad("stream", "must be a boolean.")
    options = body.get("stream_options")
    if options is not None:
        if not chat.stream:
            raise bad("stream_options", "is only allowed when stream is true.")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", 'supports only {"include_usage": bool}.')
        chat.include_usage = options.get("include_usage") is True
    return chat


def decode_image(url: str, where: str) -> Image.Image:
    """A data: URL to RGB pixels, on a worker thread (never the MLX thread)."""
    header, _, data = url.partition(",")
    try:
        if header.endswith(";base64") and len(data) <= MAX_IMAGE_BYTES * 4 // 3:
            image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
            return image.convert("RGB")
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError):
        pass
    raise bad(where, "must be a base64 data: URL of an image of at most 20 MB.")


@mlx_pinned.on_mlx_thread(thread=mlx_thread)
def load(path: str) -> tuple[Any, Any]:
    """Run once by the lifespan, on the MLX thread."""
    model, processor = mlx_vlm.load(path)
    return model, processor


# Qwen-VL models keep per-request state on the model object, so generations
# on one model must not interleave: streams that share an exclusive key take
# turns on the MLX thread (mlx-pinned serve batches them instead).
@mlx_pinned.on_mlx_thread(thread=mlx_thread, exclusive="model")
def generate(
    model: Any, processor: Any, chat: Chat, images: list[Image.Image]
) -> Iterator[tuple[str, str | None, int, int]]:
    """Yield ``(text, finish_reason, prompt_tokens, completion_tokens)`` per
    token, on the MLX thread; closed there if the client goes away."""
    prompt = mlx_vlm.apply_chat_template(
        processor, model.config, chat.messages, num_images=len(images)
    )
    if chat.seed is not None:  # the key keeps other generations off the RNG
        mx.random.seed(chat.seed)
    sampling = {"temperature": chat.temperature, "top_p": chat.top_p}
    results = mlx_vlm.stream_generate(
        model, processor, prompt, images or None, max_tokens=chat.max_tokens, **sampling
    )
    for r in results:
        yield r.text, r.finish_reason, r.prompt_tokens, r.generation_tokens


Delta = tuple[str, str | None, dict[str, int]]  # text, finish reason, usage


def answer(
    model: Any, processor: Any, chat: Chat, images: list[Image.Image]
) -> AsyncGenerator[Delta, None]:
    """The text deltas of one generation, the last with the finish reason.
    On the event loop; the stream is queued at once (a full queue raises
    MLXThreadBusyError here). Text that may start a stop string waits."""
    pieces = generate(model, processor, chat, images)
    hold = max(map(len, chat.stop), default=1) - 1

    async def deltas() -> AsyncGenerator[Delta, None]:
        held = ""
        # aclosing: a stop string or a client gone closes the generator on
        # the MLX thread, which frees the key for the next request.
        async with contextlib.aclosing(pieces):
            async for text, reason, prompt, completion in pieces:
                held += text
                cuts = [i for i in map(held.find, chat.stop) if i >= 0]
                if cuts:
                    held, reason = held[: min(cuts)], "stop"
                usage = {"prompt_tokens": prompt, "completion_tokens": completion}
                usage["total_tokens"] = prompt + completion
                if reason is not None:
                    yield held, reason, usage
                    return
                if len(held) > hold:
                    yield held[: len(held) - hold], None, usage
                    held = held[len(held) - hold :]

    return deltas()


async def completions(request: Request) -> Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("body", "is not valid JSON.") from None
    served = request.app.state.name
    chat = parse(body, served)
    images = [
        await anyio.to_thread.run_sync(decode_image, url, where)
        for url, where in chat.images
    ]
    model, processor = request.state.model
    # Before the response starts: a full queue answers 503 with Retry-After.
    deltas = answer(model, processor, chat, images)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time())}
    head["model"] = served
    if not chat.stream:
        done = [delta async for delta in deltas]
        message = {"role": "assistant", "content": "".join(d[0] for d in done)}
        choice = {"index": 0, "message": message, "finish_reason": done[-1][1]}
        result = head | {"object": "chat.completion", "choices": [choice]}
        return JSONResponse(result | {"usage": done[-1][2]})

    def event(delta: dict[str, str], reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        chunk = head | {"object": "chat.completion.chunk", "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"

    async def events() -> AsyncIterator[str]:
        yield event({"role": "assistant", "content": ""})
        try:
            async with contextlib.aclosing(deltas):
                async for text, reason, usage in deltas:
                    if text:
                        yield event({"content": text})
                    if reason is not None:
                        yield event({}, reason)
                        if chat.include_usage:
                            chunk = head | {"object": "chat.completion.chunk"}
                            chunk |= {"choices": [], "usage": usage}
                            yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # the status is sent: the error goes in the stream
            logger.exception("generation failed")
            yield f"data: {json.dumps(openai_error(exc)[1])}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request: Request) -> JSONResponse:
    card = {"id": request.app.state.name, "object": "model", "owned_by": "mlx-pinned"}
    return JSONResponse({"object": "list", "data": [card | {"created": 0}]})


def create_app(model_path: str, name: str) -> Starlette:
    # The thread starts with the app and stops after the server has finished
    # its requests; the model loads on it before the first one, into
    # request.state.model.
    lifespan = mlx_pinned.mlx_lifespan(
        thread=mlx_thread, startup={"model": functools.partial(load.sync, model_path)}
    )
    # Exception: a 500 in OpenAI's shape, and Starlette logs the traceback.
    errors = (APIError, HTTPException, BusyError, ClosedError, BrokenError, Exception)
    handlers: Any = dict.fromkeys(errors, error_response)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
        ],
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.name = name
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="A small OpenAI-compatible server.")
    parser.add_argument("--model", help="model folder (default: the tiny model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    path = args.model or str(tiny_vlm_path())
    app = create_app(path, args.model or DEMO_NAME)
    # On SIGTERM uvicorn shuts down gracefully (the lifespan stops the MLX
    # thread), then raises the signal again: exit 0 then, not "killed".
    signal.signal(signal.SIGTERM, _exit_zero)
    uvicorn.run(app, host=args.host, port=args.port)


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    main()
