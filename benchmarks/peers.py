"""mlx-pinned's server next to its peers, on one model and one request.

Starts each server in turn on a free loopback port, on the same model folder
(the tiny Qwen3-VL of ``mlx_pinned.testing`` by default; ``--size bench``
its bench model, ``--size tiny,bench`` both in one run, reported side by
side: docs/benchmarks.md says what each size stands for), waits until it
answers, warms it up, then sends the same request (a 64x64 JPEG, "Describe
this image in one sentence.", 32 tokens, temperature 0, non-streaming) at
each concurrency, several rounds each, and stops it before the next one
starts. Per system and concurrency it prints requests answered, aggregate
completion tokens/s (median of the rounds), p50/p99 latency, time to first
token (one streaming probe per round, sent with the load, not counted in it)
and errors, then the ratios against vllm-mlx, and writes a PNG.

``--api`` names the door every request of the run goes through: ``chat``
(``/v1/chat/completions``, the default), ``responses`` (``/v1/responses``:
``input`` with ``input_text`` and ``input_image`` parts,
``max_output_tokens``, ``store`` false) or ``messages`` (Anthropic's
``/v1/messages``: the image as a base64 source, ``max_tokens``, an
``anthropic-version`` header). The streaming probe times the first text delta
of that API's own events (``response.output_text.delta``, a
``content_block_delta`` with a ``text_delta``). A system that answers the
API's path with 404 or 405 is skipped, with a line saying so.

::

    python benchmarks/peers.py run [--systems ...] [--concurrency 1,8,32]
        [--rounds 3] [--api chat|responses|messages] [--peers-venv VENV]
        [--plot peers.png] [--text] [--size tiny|bench|tiny,bench]
    python benchmarks/peers.py inprocess [--size ...]  # batched vs one at a time
    python benchmarks/peers.py plot RESULTS.json --plot peers.png --title ...

Systems (``--systems``, comma-separated; override a command with
``--cmd NAME='TEMPLATE'``, fields ``{python} {peers_bin} {model} {port}
{self}``):

- ``mlx-pinned``: ``python -m mlx_pinned.server serve MODEL`` (continuous
  batching, ``--max-num-seqs 32``);
- ``mlx-pinned-serial``: the same with ``--max-num-seqs 1`` (one generation
  at a time: a batch of one);
- ``vllm-mlx``, ``vllm-mlx-cb``: ``vllm-mlx serve MODEL --mllm``, without and
  with ``--continuous-batching``;
- ``mlx-vlm``: ``python -m mlx_vlm.server --model MODEL``.

With ``--text`` the model is a text-only one (the tiny or bench Qwen3 of
``mlx_pinned.testing`` by default, copied with mlx-lm's
weight names, which mlx-vlm loads too), the request the same
prompt without the image, and the systems ``mlx-pinned`` (and
``mlx-pinned-nocache``, without its prompt cache), ``vllm-mlx`` and
``vllm-mlx-cb`` (``vllm-mlx serve MODEL``, without ``--mllm``) and
``mlx-lm`` (``python -m mlx_lm.server --model MODEL``).

The peers live in their own virtual environment (vllm-mlx 0.6.0 installs on
Linux beside ``mlx[cpu]``), given by ``--peers-venv`` or
``$MLX_PINNED_PEERS_VENV``; it is needed only when a peer is among the
systems::

    python -m venv VENV
    VENV/bin/pip install vllm-mlx==0.6.0 'mlx[cpu]==0.32.4' mlx-vlm==0.7.10 mlx-lm

This script needs ``httpx`` and ``matplotlib`` beside mlx-pinned. It is
expensive (every server, every level, every round): run it on a quiet
machine, never in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    PROMPT,
    free_port,
    model_path,
    positive_ints,
    quantile,
    request_body,
    server,
    size_option,
    sse_json,
    wait_for,
)

SERVED_NAME = "tiny"

COMMANDS: dict[str, str] = {
    "mlx-pinned": "{python} -m mlx_pinned.server serve {model} --port {port} "
    f"--served-model-name {SERVED_NAME} --log-level warning --max-pending 1024 "
    "--max-num-seqs 32",
    "mlx-pinned-serial": "{python} -m mlx_pinned.server serve {model} --port {port} "
    f"--served-model-name {SERVED_NAME} --log-level warning --max-pending 1024 "
    "--max-num-seqs 1",
    "vllm-mlx": "{peers_bin}/vllm-mlx serve {model} --mllm --port {port}",
    "vllm-mlx-cb": "{peers_bin}/vllm-mlx serve {model} --mllm --port {port} "
    "--continuous-batching",
    "mlx-vlm": "{peers_bin}/python -m mlx_vlm.server --model {model} --port {port}",
}
TEXT_COMMANDS: dict[str, str] = {
    "mlx-pinned": COMMANDS["mlx-pinned"],
    # Every request of the run is the same: the prompt cache answers the
    # prompt from the second on; this row is the engine without it.
    "mlx-pinned-nocache": COMMANDS["mlx-pinned"] + " --prompt-cache-bytes 0",
    "vllm-mlx": "{peers_bin}/vllm-mlx serve {model} --port {port}",
    "vllm-mlx-cb": "{peers_bin}/vllm-mlx serve {model} --port {port} "
    "--continuous-batching",
    "mlx-lm": "{peers_bin}/python -m mlx_lm.server --model {model} --port {port}",
}
BASELINE = "vllm-mlx-cb"
PEERS_VENV_ENV = "MLX_PINNED_PEERS_VENV"


# -- the APIs ---------------------------------------------------------------------


def responses_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completions body as OpenAI Responses sends it: ``input`` items
    with ``input_text`` and ``input_image`` parts, ``max_output_tokens``, and
    nothing stored (as Codex sends it)."""
    parts = {"text": "input_text", "image_url": "input_image"}
    items = []
    for message in chat["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": parts[part["type"]], "text": part["text"]}
                if part["type"] == "text"
                else {
                    "type": parts[part["type"]],
                    "image_url": part["image_url"]["url"],
                }
                for part in content
            ]
        items.append({"type": "message", "role": message["role"], "content": content})
    return {
        "model": chat["model"],
        "input": items,
        "max_output_tokens": chat["max_tokens"],
        "temperature": chat["temperature"],
        "store": False,
    }


def messages_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completions body as Anthropic Messages sends it: text blocks,
    the image as a base64 source, ``max_tokens``."""

    def block(part: dict[str, Any]) -> dict[str, Any]:
        if part["type"] == "text":
            return {"type": "text", "text": part["text"]}
        header, _, data = part["image_url"]["url"].partition(",")
        media_type = header.removeprefix("data:").removesuffix(";base64")
        source = {"type": "base64", "media_type": media_type, "data": data}
        return {"type": "image", "source": source}

    messages = [
        {
            "role": message["role"],
            "content": [block(part) for part in message["content"]]
            if isinstance(message["content"], list)
            else message["content"],
        }
        for message in chat["messages"]
    ]
    return {
        "model": chat["model"],
        "messages": messages,
        "max_tokens": chat["max_tokens"],
        "temperature": chat["temperature"],
    }


def _chat_text(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def _responses_text(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.output_text.delta" and bool(
        event.get("delta")
    )


def _messages_text(event: dict[str, Any]) -> bool:
    delta = event.get("delta") or {}
    return (
        event.get("type") == "content_block_delta"
        and delta.get("type") == "text_delta"
        and bool(delta.get("text"))
    )


@dataclass(frozen=True)
class Api:
    """One door of the servers: where the request goes, its shape (from the
    chat completions body), where its answer counts the completion tokens,
    and which of its stream's events carries the first text."""

    path: str
    shape: Callable[[dict[str, Any]], dict[str, Any]]
    usage: tuple[str, str]  # the prompt's and the completion's token counts
    first_text: Callable[[dict[str, Any]], bool]
    headers: dict[str, str] = field(default_factory=dict)

    def tokens(self, answer: dict[str, Any], which: int = 1) -> int:
        return int((answer.get("usage") or {}).get(self.usage[which]) or 0)


APIS: dict[str, Api] = {
    "chat": Api(
        "/v1/chat/completions",
        dict,
        ("prompt_tokens", "completion_tokens"),
        _chat_text,
    ),
    "responses": Api(
        "/v1/responses",
        responses_body,
        ("input_tokens", "output_tokens"),
        _responses_text,
    ),
    "messages": Api(
        "/v1/messages",
        messages_body,
        ("input_tokens", "output_tokens"),
        _messages_text,
        {"anthropic-version": "2023-06-01"},
    ),
}


# -- one load level ---------------------------------------------------------------


@dataclass
class Level:
    """What one system did at one concurrency, over all its rounds."""

    system: str
    concurrency: int
    api: str = "chat"
    # The first answer's prompt tokens: the same request is the same prompt
    # on every system (a peer that drops the image counts fewer).
    prompt_tokens: int = 0
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)  # one per round
    latencies: list[float] = field(default_factory=list)  # seconds, ok only
    ttfts: list[float] = field(default_factory=list)  # seconds, one per round
    size: str = "tiny"  # the model's (docs/benchmarks.md), or "model": --model

    @property
    def tok_s(self) -> float:
        return statistics.median(self.tokens_per_s) if self.tokens_per_s else 0.0

    def latency(self, q: float) -> float:
        return quantile(self.latencies, q)

    @property
    def ttft(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else math.nan

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_round(
    client: Any, api: Api, body: dict[str, Any], level: Level, requests: int
) -> None:
    """``requests`` requests from ``level.concurrency`` workers, plus a probe
    (its time to the first text delta of ``api``'s stream)."""
    remaining = requests
    tokens = 0

    async def worker() -> None:
        nonlocal remaining, tokens
        while remaining > 0:
            remaining -= 1
            level.sent += 1
            start = time.perf_counter()
            try:
                response = await client.post(api.path, json=body, headers=api.headers)
            except Exception as exc:
                level.error(type(exc).__name__)
                continue
            if response.status_code != 200:
                level.error(str(response.status_code))
                continue
            level.latencies.append(time.perf_counter() - start)
            level.ok += 1
            tokens += api.tokens(response.json())

    async def probe() -> None:
        start = time.perf_counter()
        with contextlib.suppress(Exception):
            async with client.stream(
                "POST", api.path, json={**body, "stream": True}, headers=api.headers
            ) as response:
                async for event in sse_json(response):
                    if api.first_text(event):
                        level.ttfts.append(time.perf_counter() - start)
                        return

    start = time.perf_counter()
    probing = asyncio.ensure_future(probe())
    await asyncio.gather(*(worker() for _ in range(level.concurrency)))
    level.tokens_per_s.append(tokens / (time.perf_counter() - start))
    await probing


# -- servers ----------------------------------------------------------------------


async def wait_ready(
    client: Any, process: subprocess.Popen[bytes], timeout: float
) -> str:
    """Wait until ``GET /v1/models`` answers; the served model id."""
    response = await wait_for(client, process, "/v1/models", timeout)
    try:
        data = response.json().get("data") or [{}]
    except ValueError:
        # mlx-lm's server answers 200, then fails to list models when the
        # Hugging Face cache folder is missing: it is up, and takes the path.
        return ""
    return str(data[0].get("id") or "")


class Unserved(Exception):
    """The server has no such API (404 or 405 on its path)."""


async def first_answer(
    client: Any, api: Api, body: dict[str, Any], timeout: float
) -> int:
    """Send ``body`` until it is answered 200: a server may list its model
    (mlx-pinned does) and answer 503 until the model is loaded. The answer's
    prompt tokens."""
    deadline = time.monotonic() + timeout
    while True:
        response = await client.post(api.path, json=body, headers=api.headers)
        if response.status_code == 200:
            return api.tokens(response.json(), 0)
        if response.status_code in (404, 405):
            # A server may answer 404 for an unknown model too: its words say.
            raise Unserved(
                f"{api.path} answered {response.status_code}: {response.text[:200]}"
            )
        if response.status_code != 503 or time.monotonic() > deadline:
            raise RuntimeError(f"answered {response.status_code}: {response.text}")
        await asyncio.sleep(0.2)


async def bench_system(
    name: str,
    command: list[str],
    args: argparse.Namespace,
    make_body: Callable[[str], dict[str, Any]],
    size: str,
    model: Path,
) -> list[Level]:
    """``name``'s levels on the ``size`` model, ``model``, which ``command``
    serves."""
    import httpx

    port = int(command[command.index("--port") + 1]) if "--port" in command else 0
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"peers-{name}-{size}.log"
    levels: list[Level] = []
    print(f"\n== {name}: {' '.join(command)}  (log: {log})", flush=True)
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
    with server(command, log) as process:
        async with httpx.AsyncClient(
            base_url=base, timeout=args.request_timeout, limits=limits
        ) as client:
            try:
                served = await wait_ready(client, process, args.startup_timeout)
            except Exception as exc:
                print(f"   not started: {exc}\n{_tail(log)}", flush=True)
                return []
            api = APIS[args.api]
            body = api.shape(make_body(served or str(model)))
            try:
                prompt_tokens = await first_answer(
                    client, api, body, args.startup_timeout
                )
            except Unserved as exc:
                print(f"   skipped: {name} does not serve {args.api} ({exc})")
                return []
            except Exception as exc:
                print(f"   never answered: {exc}\n{_tail(log)}", flush=True)
                return []
            for _ in range(args.warmup):
                await client.post(api.path, json=body, headers=api.headers)
            for concurrency in args.concurrency:
                level = Level(name, concurrency, args.api, prompt_tokens, size=size)
                requests = max(args.requests, 2 * concurrency)
                for _ in range(args.rounds):
                    await one_round(client, api, body, level, requests)
                print("   " + _row(level), flush=True)
                levels.append(level)
    return levels


def _tail(log: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


# -- reporting --------------------------------------------------------------------


def _row(level: Level) -> str:
    errors = ", ".join(f"{n}x{k}" for k, n in sorted(level.errors.items())) or "-"
    return (
        f"{level.system:<19} {level.size:<5} c{level.concurrency:<3} "
        f"{level.ok:>4}/{level.sent:<4} "
        f"prompt {level.prompt_tokens:>4}  "
        f"{level.tok_s:7.0f} tok/s  p50 {level.latency(0.5) * 1e3:7.1f} ms  "
        f"p99 {level.latency(0.99) * 1e3:7.1f} ms  ttft {level.ttft * 1e3:6.1f} ms  "
        f"errors {errors}"
    )


def side_by_side(levels: list[Level]) -> list[Level]:
    """``levels`` by system, then concurrency, then size (each in the order
    first measured): one system's sizes next to each other."""
    systems = list(dict.fromkeys(lv.system for lv in levels))
    sizes = list(dict.fromkeys(lv.size for lv in levels))
    return sorted(
        levels,
        key=lambda lv: (systems.index(lv.system), lv.concurrency, sizes.index(lv.size)),
    )


def report(levels: list[Level]) -> None:
    print(
        "\n| system | size | api | c | prompt tok | ok | tok/s | p50 ms | p99 ms "
        "| TTFT ms | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lv in side_by_side(levels):
        errors = ", ".join(f"{n}x{k}" for k, n in sorted(lv.errors.items())) or "0"
        print(
            f"| {lv.system} | {lv.size} | {lv.api} | {lv.concurrency} "
            f"| {lv.prompt_tokens} "
            f"| {lv.ok}/{lv.sent} | {lv.tok_s:.0f} "
            f"| {lv.latency(0.5) * 1e3:.1f} | {lv.latency(0.99) * 1e3:.1f} "
            f"| {lv.ttft * 1e3:.1f} | {errors} |"
        )
    base = {(lv.size, lv.concurrency): lv for lv in levels if lv.system == BASELINE}
    if not base:
        return
    print(
        f"\nratios against {BASELINE} on the same model "
        "(tok/s; p50 latency, lower is better):"
    )
    for lv in side_by_side(levels):
        ref = base.get((lv.size, lv.concurrency))
        if ref is None or lv.system == BASELINE or not ref.tok_s:
            continue
        print(
            f"  {lv.system:<19} {lv.size:<5} c{lv.concurrency:<3} "
            f"{lv.tok_s / ref.tok_s:5.2f}x "
            f"tok/s, {lv.latency(0.5) / ref.latency(0.5):5.2f}x p50"
        )


def plot(levels: list[Level], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len({lv.size for lv in levels}) > 1

    def shown(lv: Level) -> str:
        return f"{lv.system} ({lv.size})" if several else lv.system

    systems = list(dict.fromkeys(shown(lv) for lv in levels))
    concurrencies = sorted({lv.concurrency for lv in levels})
    by = {(shown(lv), lv.concurrency): lv for lv in levels}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(concurrencies))]
        rows = [by.get((system, c)) for c in concurrencies]
        left.bar(xs, [r.tok_s if r else 0 for r in rows], width, label=system)
        for x, r in zip(xs, rows, strict=True):
            if r is not None and r.ok < r.sent:  # say how many were refused
                left.annotate(
                    f"{r.sent - r.ok} err",
                    (x, r.tok_s),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
        right.bar(
            xs, [r.latency(0.5) * 1e3 if r else 0 for r in rows], width, label=system
        )
    for axis, label in ((left, "completion tokens/s"), (right, "p50 latency (ms)")):
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(concurrencies))])
        axis.set_xticklabels([f"c{c}" for c in concurrencies])
        axis.set_ylabel(label)
    right.set_yscale("log")
    right.set_title("successful requests only", fontsize=8)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


# -- commands ---------------------------------------------------------------------


def text_body(model: str, max_tokens: int) -> dict[str, Any]:
    """The bug report's prompt without its image, greedy."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def mlx_lm_layout(model: Path) -> Path:
    """A copy of a tiny text model of ``mlx_pinned.testing`` that mlx-lm
    loads too: the same weights under mlx-lm's names (mlx-vlm's carry a
    ``language_model.`` prefix, which mlx-lm's loader refuses; mlx-vlm adds it
    back itself), the other files as they are."""
    import shutil

    import mlx.core as mx

    copy = Path(tempfile.gettempdir()) / f"peers-{model.name}-mlx-lm"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(model, copy)
    weights = copy / "model.safetensors"
    arrays = mx.load(str(weights))
    assert isinstance(arrays, dict)
    mx.save_safetensors(
        str(weights), {k.removeprefix("language_model."): v for k, v in arrays.items()}
    )
    return copy


def models(args: argparse.Namespace, model_type: str) -> dict[str, Path]:
    """The run's model folder of each size asked (``--model``: that one)."""
    if args.model:
        return {"model": Path(args.model)}
    return {size: model_path(size, model_type) for size in args.size}


def run(args: argparse.Namespace) -> int:
    from mlx_pinned.testing import image_data_uri

    if args.text:
        folders = models(args, "qwen3")
        if not args.model:
            folders = {size: mlx_lm_layout(path) for size, path in folders.items()}
        commands = dict(TEXT_COMMANDS)
        what = "text only"

        def make_body(model: str) -> dict[str, Any]:
            return text_body(model, args.max_tokens)
    else:
        folders = models(args, "qwen3_vl")
        image_uri = image_data_uri(64, 64, "JPEG")
        commands = dict(COMMANDS)
        what = "64x64 JPEG"

        def make_body(model: str) -> dict[str, Any]:
            return request_body(model, image_uri, args.max_tokens)

    args.systems = args.systems or list(commands)
    for override in args.cmd:
        name, _, template = override.partition("=")
        commands[name] = template
    templates = [commands.get(name, "") for name in args.systems]
    if args.peers_venv is None and any("{peers_bin}" in t for t in templates):
        raise SystemExit(
            f"a peer is among the systems: give its virtual environment with "
            f"--peers-venv or ${PEERS_VENV_ENV}"
        )
    fields = {
        "python": sys.executable,
        "peers_bin": str(Path(args.peers_venv or ".") / "bin"),
        "self": str(Path(__file__).resolve()),
    }
    unknown = [name for name in args.systems if name not in commands]
    if unknown:
        raise SystemExit(f"unknown system {unknown[0]!r}: one of {sorted(commands)}")
    levels: list[Level] = []
    for size, folder in folders.items():
        for name in args.systems:
            command = (
                commands[name].format(**fields, model=folder, port=free_port()).split()
            )
            levels += asyncio.run(
                bench_system(name, command, args, make_body, size, folder)
            )
    report(levels)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(lv) for lv in levels], indent=1))
    if args.plot and levels:
        title = (
            f"same request through {APIS[args.api].path} ({what}, "
            f"{args.max_tokens} tokens, non-streaming, {'+'.join(folders)} model), "
            f"{args.rounds} rounds, {os.cpu_count()} CPUs"
        )
        plot(levels, Path(args.plot), title)
    return 0


def inprocess(args: argparse.Namespace) -> int:
    """The engine batched (up to ``concurrency`` rows) vs one at a time (a
    batch of one), in process."""
    import io

    import anyio
    from PIL import Image

    from mlx_pinned import MLXThread
    from mlx_pinned.server.config import ModelSettings
    from mlx_pinned.server.engine import BatchEngine
    from mlx_pinned.server.events import FinalEvent, GenerationParams, SamplingParams
    from mlx_pinned.server.http.served_models import BatchGate
    from mlx_pinned.testing import make_test_image

    image = Image.open(io.BytesIO(make_test_image())).convert("RGB")
    content = [{"type": "text", "text": PROMPT}, {"type": "image_url"}]
    params = GenerationParams(
        ({"role": "user", "content": content},),
        max_tokens=args.max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )

    async def level(engine: Any, mode: str, concurrency: int, size: str) -> Level:
        result = Level(mode, concurrency, size=size)
        gate = BatchGate(concurrency if mode == "batched" else 1, 4096)

        def start_stream() -> Any:
            return engine.stream(params, [image])

        for _ in range(args.rounds):
            remaining = max(args.requests, 2 * concurrency)
            tokens = 0

            async def worker() -> None:
                nonlocal remaining, tokens
                while remaining > 0:
                    remaining -= 1
                    start = time.perf_counter()
                    first = None
                    async with gate.turn():
                        stream = start_stream()
                        async with stream:
                            async for event in stream:
                                first = first or time.perf_counter()
                                if isinstance(event, FinalEvent):
                                    tokens += event.completion_tokens
                    result.latencies.append(time.perf_counter() - start)
                    result.ttfts.append((first or start) - start)
                    result.ok += 1
                    result.sent += 1

            start = time.perf_counter()
            async with anyio.create_task_group() as group:
                for _ in range(concurrency):
                    group.start_soon(worker)
            result.tokens_per_s.append(tokens / (time.perf_counter() - start))
        return result

    async def main() -> list[Level]:
        levels = []
        async with MLXThread(name="peers-inprocess") as thread:
            for size in args.size:
                # As the server's engine, without its caches (each request new).
                settings = ModelSettings.of(
                    model_path(size),
                    prompt_cache_bytes=0,
                    image_cache_bytes=0,
                    prefill_step_seconds=None,
                )
                engine = await thread.run(BatchEngine.load, settings, thread)
                for concurrency in args.concurrency:
                    for mode in ("one-at-a-time", "batched"):
                        await level(engine, mode, concurrency, size)  # warm-up
                        levels.append(await level(engine, mode, concurrency, size))
                        print("   " + _row(levels[-1]), flush=True)
        return levels

    report(anyio.run(main))
    return 0


def replot(args: argparse.Namespace) -> int:
    """The table and the plot again, from ``run --json``'s results."""
    levels = [Level(**raw) for raw in json.loads(Path(args.results).read_text())]
    report(levels)
    plot(levels, Path(args.plot), args.title)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--concurrency", type=positive_ints, default=[1, 8, 32])
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--requests", type=int, default=16, help="per round, at least")
        p.add_argument("--max-tokens", type=int, default=32)
        size_option(p)

    bench = commands.add_parser("run", help="start each server and load it")
    common(bench)
    bench.add_argument("--model", help="model folder (default: --size's)")
    bench.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        help="default: every system of the run's kind",
    )
    bench.add_argument(
        "--text",
        action="store_true",
        help="a text-only model and request, against vllm-mlx and mlx-lm",
    )
    bench.add_argument(
        "--api",
        choices=sorted(APIS),
        default="chat",
        help="the door every request goes through (default: chat completions)",
    )
    bench.add_argument(
        "--peers-venv",
        default=os.environ.get(PEERS_VENV_ENV),
        help=f"the peers' virtual environment (default: ${PEERS_VENV_ENV})",
    )
    bench.add_argument("--cmd", action="append", default=[], metavar="NAME=TEMPLATE")
    bench.add_argument("--warmup", type=int, default=3)
    bench.add_argument("--startup-timeout", type=float, default=180)
    bench.add_argument("--request-timeout", type=float, default=300)
    bench.add_argument("--plot", default="peers.png")
    bench.add_argument("--json", help="also write the raw results here")
    bench.set_defaults(handler=run)

    local = commands.add_parser("inprocess", help="batched vs one at a time")
    common(local)
    local.set_defaults(handler=inprocess)

    again = commands.add_parser("plot", help="plot the results of run --json")
    again.add_argument("results")
    again.add_argument("--plot", default="peers.png")
    again.add_argument("--title", default="")
    again.set_defaults(handler=replot)

    args = parser.parse_args(argv)
    handler: Any = args.handler
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
