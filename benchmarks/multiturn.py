"""Time to first token, turn by turn, in a 4-turn chat about one image.

Each system is started in turn on the same model folder (the tiny Qwen3-VL
of ``mlx_pinned.testing`` by default; ``--size bench`` its bench model,
``--size tiny,bench`` both, in one table). Per round, a conversation: a system
prompt and one image with a first question, then three follow-ups; every
turn sends the whole history (the server's own earlier answers included), as
chat clients do, streaming, greedy, ``--max-tokens`` tokens. The time to the
first content token is taken per turn; each round has its own image and
opening question, so nothing is shared across rounds. Prints the median per
turn and system, turn 4 against turn 1 and against mlx-pinned without its
prompt cache, and writes a PNG.

::

    python benchmarks/multiturn.py [--systems mlx-pinned,mlx-pinned-nocache,...]
        [--rounds 5] [--max-tokens 32] [--peers-venv VENV] [--plot multiturn.png]
        [--size tiny|bench|tiny,bench]

Systems: ``mlx-pinned`` (prompt cache on, its default), ``mlx-pinned-nocache``
(``--prompt-cache-bytes 0``), ``mlx-pinned-restarted`` (``--state-dir``, and
restarted before each conversation's turn 4: its prefix comes from the prompt
cache's disk tier; each start warmed up by a conversation of its own), and
the peers ``vllm-mlx-cb`` (``--continuous-
batching``, its prefix cache on by default) and ``mlx-vlm`` (its server), from
the virtual environment given by ``--peers-venv`` or ``$MLX_PINNED_PEERS_VENV``
(see ``peers.py``). Expensive: a quiet machine, never CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from _common import free_port, model_path, server, size_option, wait_for

PEERS_VENV_ENV = "MLX_PINNED_PEERS_VENV"
SYSTEM = (
    "You are a careful assistant for a visually impaired user. Describe what "
    "matters in the picture, in plain words, without guessing; say when "
    "something cannot be seen. Keep every answer short and concrete. " * 4
)
QUESTIONS = (
    "What is in this picture?",
    "What colours stand out?",
    "Is there any text or a sign?",
    "Summarise it in five words.",
)
COMMANDS = {
    "mlx-pinned": "{python} -m mlx_pinned.server serve {model} --port {port} "
    "--served-model-name tiny --log-level warning",
    "mlx-pinned-restarted": "{python} -m mlx_pinned.server serve {model} "
    "--port {port} --served-model-name tiny --log-level warning "
    "--state-dir {state_dir}",
    "mlx-pinned-nocache": "{python} -m mlx_pinned.server serve {model} "
    "--port {port} --served-model-name tiny --log-level warning "
    "--prompt-cache-bytes 0",
    "vllm-mlx-cb": "{peers_bin}/vllm-mlx serve {model} --mllm --port {port} "
    "--continuous-batching",
    "mlx-vlm": "{peers_bin}/python -m mlx_vlm.server --model {model} --port {port}",
}


async def first_token(client: Any, body: dict[str, Any]) -> tuple[float, str]:
    """Stream one turn: seconds to the first content token, and the answer."""
    start = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                if not parts:
                    ttft = time.perf_counter() - start
                parts.append(content)
    return ttft, "".join(parts)


def opening(image_uri: str, round_index: int) -> list[dict[str, Any]]:
    """A conversation's first messages: the system prompt, the image and
    the first question."""
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_uri}},
                {"type": "text", "text": f"({round_index}) {QUESTIONS[0]}"},
            ],
        },
    ]


async def turns(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    numbers: range,
    max_tokens: int,
) -> list[float]:
    """Turns ``numbers`` (0 to 3) of a conversation, ``messages`` so far
    (each answer appended); the time to first token of each."""
    times = []
    for turn in numbers:
        if turn:
            messages.append({"role": "user", "content": QUESTIONS[turn]})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        ttft, answer = await first_token(client, body)
        times.append(ttft)
        messages.append({"role": "assistant", "content": answer})
    return times


async def conversation(
    client: Any, model: str, image_uri: str, round_index: int, max_tokens: int
) -> list[float]:
    """One 4-turn conversation; the time to first token of each turn."""
    messages = opening(image_uri, round_index)
    return await turns(client, model, messages, range(len(QUESTIONS)), max_tokens)


async def bench(
    name: str, command: list[str], args: argparse.Namespace, folder: str
) -> list[list[float]]:
    """``name``'s rounds on the model in ``folder``, which ``command`` serves."""
    from mlx_pinned.testing import image_data_uri

    log = Path(tempfile.gettempdir()) / f"multiturn-{name}-{Path(folder).name}.log"
    print(f"\n== {name}: {' '.join(command)}  (log: {log})", flush=True)
    rounds: list[list[float]] = []
    images = [
        image_data_uri(args.image_size, args.image_size, "JPEG", seed=index)
        for index in range(args.rounds)
    ]
    if name.endswith("-restarted"):
        # Turns 1-3, a restart (the conversation's KV on disk only), turn 4.
        for index, uri in enumerate(images):
            messages = opening(uri, index)
            async with running(command, log, args, folder) as (client, model):
                times = await turns(client, model, messages, range(3), args.max_tokens)
            async with running(command, log, args, folder) as (client, model):
                times += await turns(
                    client, model, messages, range(3, 4), args.max_tokens
                )
            print("   " + "  ".join(f"{t * 1e3:7.1f}" for t in times), flush=True)
            rounds.append(times)
        return rounds
    async with running(command, log, args, folder) as (client, model):
        for index, uri in enumerate(images):
            times = await conversation(client, model, uri, index, args.max_tokens)
            print("   " + "  ".join(f"{t * 1e3:7.1f}" for t in times), flush=True)
            rounds.append(times)
    return rounds


@contextlib.asynccontextmanager
async def running(
    command: list[str], log: Path, args: argparse.Namespace, folder: str
) -> AsyncIterator[tuple[Any, str]]:
    """The system of ``command``, warmed up by one conversation of its own;
    a client of it and the model's name. Stopped (SIGTERM) at the end."""
    import httpx

    from mlx_pinned.testing import image_data_uri

    port = int(command[command.index("--port") + 1])
    with server(command, log) as process:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=300
        ) as client:
            response = await wait_for(client, process, "/v1/models", 180)
            model = str((response.json().get("data") or [{}])[0].get("id") or "")
            model = model or folder
            warm = image_data_uri(64, 64, "JPEG", seed=10_000)
            await conversation(client, model, warm, -1, args.max_tokens)
            yield client, model


def report(
    results: dict[str, list[list[float]]], suffixes: list[str]
) -> dict[str, list[float]]:
    """The table; ``suffixes`` end the names of each size's systems."""
    medians = {
        name: [statistics.median(r[turn] for r in rounds) for turn in range(4)]
        for name, rounds in results.items()
        if rounds
    }
    print("\nmedian time to first token (ms), per turn")
    print(f"{'system':<30}" + "".join(f"{'turn ' + str(t + 1):>10}" for t in range(4)))
    for name, values in medians.items():
        print(f"{name:<30}" + "".join(f"{v * 1e3:10.1f}" for v in values))
    for suffix in suffixes:
        base = medians.get("mlx-pinned-nocache" + suffix)
        for name, values in medians.items():
            if not name.endswith(suffix):
                continue
            line = f"{name}: turn 4 / turn 1 {values[3] / values[0]:.2f}x"
            if base:
                line += f"; turn 4 vs mlx-pinned-nocache {values[3] / base[3]:.2f}x"
            print(line)
    return medians


def plot(medians: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in medians.items():
        ax.plot(range(1, 5), [v * 1e3 for v in values], marker="o", label=name)
    ax.set_xticks(range(1, 5))
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, median (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="mlx-pinned,mlx-pinned-nocache")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--model", help="model folder (default: --size's)")
    size_option(parser)
    parser.add_argument("--peers-venv", default=os.environ.get(PEERS_VENV_ENV))
    parser.add_argument("--plot", default="multiturn.png")
    parser.add_argument("--json", help="also write the raw times here")
    args = parser.parse_args(argv)
    sizes = ["model"] if args.model else args.size
    # One size: the systems' own names; both: each name ends with its size.
    suffixes = [f" [{size}]" if len(sizes) > 1 else "" for size in sizes]
    results: dict[str, list[list[float]]] = {}
    for size, suffix in zip(sizes, suffixes, strict=True):
        folder = args.model or str(model_path(size))
        for name in args.systems.split(","):
            template = COMMANDS[name]
            if "{peers_bin}" in template and not args.peers_venv:
                raise SystemExit(f"{name} needs --peers-venv or ${PEERS_VENV_ENV}")
            command = template.format(
                python=sys.executable,
                peers_bin=str(Path(args.peers_venv or ".") / "bin"),
                model=folder,
                port=free_port(),
                state_dir=tempfile.mkdtemp(prefix="multiturn-state-"),
            ).split()
            results[name + suffix] = asyncio.run(bench(name, command, args, folder))
    medians = report(results, suffixes)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot and medians:
        title = (
            f"4-turn image chat ({args.image_size}px JPEG, {args.max_tokens} tokens "
            f"a turn), {'+'.join(sizes)} model, {args.rounds} rounds, "
            f"{os.cpu_count()} CPUs"
        )
        plot(medians, Path(args.plot), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
