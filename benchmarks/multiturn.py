"""Time to first token, turn by turn, in a chat about one image.

Each system is started in turn on the same model folder (the tiny Qwen3-VL
of ``mlx_pinned.testing`` by default; ``--families`` runs each family
given; ``--size bench`` their bench models, ``--size tiny,bench`` both).
Per round, a conversation of ``--turns`` turns (4): a system prompt
(``--system-repeats`` times a paragraph of ~520 tokens: 4 is ~2,100) and
one image with a first question, then follow-ups; every turn sends the whole
history (the server's own earlier answers included), as chat clients do,
streaming, greedy, ``--max-tokens`` tokens. The time to the first content
token is taken per turn, and the tokens the server reports cached against
the previous turn's prompt and answer; each round has its own image and
opening question, so nothing is shared across rounds. Prints the median per
turn and system, the last turn against turn 1 and against mlx-pinned
without its prompt cache (and, per family, turns 2 on against it), and
writes a PNG.

::

    python benchmarks/multiturn.py [--systems mlx-pinned,mlx-pinned-nocache,...]
        [--rounds 5] [--max-tokens 32] [--peers-venv VENV] [--plot multiturn.png]
        [--families qwen3_vl,qwen3_5,gemma3,gemma4 --turns 5 --system-repeats 4]
        [--size tiny|bench|tiny,bench]

Systems: ``mlx-pinned`` (prompt cache on, its default), ``mlx-pinned-nocache``
(``--prompt-cache-bytes 0``), ``mlx-pinned-restarted`` (``--state-dir``, and
restarted before each conversation's turn 4: its prefix comes from the prompt
cache's disk tier; each start warmed up by a conversation of its own), and
the peers ``vllm-mlx-cb`` (``--continuous-batching``, its prefix cache
on by default), ``mlx-vlm`` (its server) and ``mlx-vlm-apc`` (with its
prefix cache, ``APC_ENABLED=1``), from
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
    "Anything else worth saying?",
    "Thank you. One last detail?",
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
    "mlx-vlm-apc": "env APC_ENABLED=1 {peers_bin}/python -m mlx_vlm.server "
    "--model {model} --port {port}",
}


async def first_token(
    client: Any, body: dict[str, Any]
) -> tuple[float, str, dict[str, Any]]:
    """Stream one turn: seconds to the first content token, the answer, and
    its usage (empty where the server reports none)."""
    start = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or [{}]
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                if not parts:
                    ttft = time.perf_counter() - start
                parts.append(content)
    return ttft, "".join(parts), usage


#: Each turn's cached tokens over the previous turn's prompt and answer
#: (turn 1: none), by system, per round; filled by :func:`turns`.
CACHED: dict[str, list[list[float]]] = {}
SYSTEM_REPEATS = [1]


def opening(image_uri: str, round_index: int) -> list[dict[str, Any]]:
    """A conversation's first messages: the system prompt, the image and
    the first question."""
    return [
        {"role": "system", "content": SYSTEM * SYSTEM_REPEATS[0]},
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
    shares: list[float] | None = None,
) -> list[float]:
    """Turns ``numbers`` of a conversation, ``messages`` so far (each answer
    appended); the time to first token of each. ``shares``: each turn's
    cached tokens over the previous turn's prompt and answer, appended."""
    times = []
    before = 0
    for turn in numbers:
        if turn:
            messages.append({"role": "user", "content": QUESTIONS[turn]})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        ttft, answer, usage = await first_token(client, body)
        times.append(ttft)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if shares is not None and turn and before and cached is not None:
            shares.append(cached / before)
        before = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        messages.append({"role": "assistant", "content": answer})
    return times


async def conversation(
    client: Any,
    model: str,
    image_uri: str,
    round_index: int,
    args: argparse.Namespace,
    shares: list[float] | None = None,
) -> list[float]:
    """One conversation; the time to first token of each turn."""
    messages = opening(image_uri, round_index)
    numbers = range(args.turns)
    return await turns(client, model, messages, numbers, args.max_tokens, shares)


async def bench(
    name: str, command: list[str], args: argparse.Namespace
) -> list[list[float]]:
    from mlx_pinned.testing import image_data_uri

    log = Path(tempfile.gettempdir()) / f"multiturn-{name.replace('/', '-')}.log"
    print(f"\n== {name}: {' '.join(command)}  (log: {log})", flush=True)
    rounds: list[list[float]] = []
    images = [
        image_data_uri(args.image_size, args.image_size, "JPEG", seed=index)
        for index in range(args.rounds)
    ]
    cached = CACHED.setdefault(name, [])
    if name.endswith("-restarted"):
        # Turns 1-3, a restart (the conversation's KV on disk only), the rest.
        for index, uri in enumerate(images):
            messages = opening(uri, index)
            shares: list[float] = []
            async with running(command, log, args) as (client, model):
                times = await turns(
                    client, model, messages, range(3), args.max_tokens, shares
                )
            async with running(command, log, args) as (client, model):
                times += await turns(
                    client, model, messages, range(3, args.turns), args.max_tokens
                )
            print("   " + "  ".join(f"{t * 1e3:7.1f}" for t in times), flush=True)
            rounds.append(times)
        return rounds
    async with running(command, log, args) as (client, model):
        for index, uri in enumerate(images):
            shares = []
            times = await conversation(client, model, uri, index, args, shares)
            print("   " + "  ".join(f"{t * 1e3:7.1f}" for t in times), flush=True)
            rounds.append(times)
            cached.append(shares)
    return rounds


@contextlib.asynccontextmanager
async def running(
    command: list[str], log: Path, args: argparse.Namespace
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
            await wait_for(client, process, "/health", 180)  # loaded
            response = await client.get("/v1/models")
            model = str((response.json().get("data") or [{}])[0].get("id") or "")
            model = model or args.model
            warm = image_data_uri(64, 64, "JPEG", seed=10_000)
            await conversation(client, model, warm, -1, args)
            yield client, model


def report(results: dict[str, list[list[float]]], count: int) -> dict[str, list[float]]:
    medians = {
        name: [statistics.median(r[turn] for r in rounds) for turn in range(count)]
        for name, rounds in results.items()
        if rounds
    }
    print("\nmedian time to first token (ms), per turn")
    header = "".join(f"{'turn ' + str(t + 1):>10}" for t in range(count))
    print(f"{'system':<30}" + header)
    for name, values in medians.items():
        print(f"{name:<30}" + "".join(f"{v * 1e3:10.1f}" for v in values))
    last = count - 1
    for name, values in medians.items():
        family, _, system = name.rpartition("/")
        base = medians.get(f"{family}/mlx-pinned-nocache" if family else system)
        base = base or medians.get("mlx-pinned-nocache")
        line = f"{name}: turn {count} / turn 1 {values[last] / values[0]:.2f}x"
        if base and base is not values:
            ratios = [values[t] / base[t] for t in range(1, count)]
            line += f"; turns 2-{count} vs no cache " + " ".join(
                f"{r:.2f}x" for r in ratios
            )
        shares = CACHED.get(name)
        if shares and all(shares):
            per_turn = [min(s[t] for s in shares) for t in range(len(shares[0]))]
            line += "; cached share (least) " + " ".join(f"{s:.0%}" for s in per_turn)
        print(line)
    return medians


def plot(medians: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in medians.items():
        turns = range(1, len(values) + 1)
        ax.plot(turns, [v * 1e3 for v in values], marker="o", label=name)
    ax.set_xticks(range(1, len(next(iter(medians.values()))) + 1))
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
    parser.add_argument("--families", help="tiny families, each its own model")
    parser.add_argument("--turns", type=int, default=4, choices=range(2, 7))
    parser.add_argument("--system-repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--model", help="model folder (default: --size's)")
    size_option(parser)
    parser.add_argument("--peers-venv", default=os.environ.get(PEERS_VENV_ENV))
    parser.add_argument("--plot", default="multiturn.png")
    parser.add_argument("--json", help="also write the raw times here")
    args = parser.parse_args(argv)
    SYSTEM_REPEATS[0] = args.system_repeats
    families = args.families.split(",") if args.families else ["qwen3_vl"]
    # Each (family, size) its own model; its label prefixes its systems'
    # names where more than one family or size runs.
    models = {
        " ".join(
            ([family] if args.families else []) + ([size] if len(args.size) > 1 else [])
        ): args.model or str(model_path(size, family))
        for family in families
        for size in args.size
    }
    results: dict[str, list[list[float]]] = {}
    for family, model in models.items():
        for name in args.systems.split(","):
            template = COMMANDS[name]
            if "{peers_bin}" in template and not args.peers_venv:
                raise SystemExit(f"{name} needs --peers-venv or ${PEERS_VENV_ENV}")
            command = template.format(
                python=sys.executable,
                peers_bin=str(Path(args.peers_venv or ".") / "bin"),
                model=model,
                port=free_port(),
                state_dir=tempfile.mkdtemp(prefix="multiturn-state-"),
            ).split()
            key = f"{family}/{name}" if family else name
            results[key] = asyncio.run(bench(key, command, args))
    medians = report(results, args.turns)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot and medians:
        title = (
            f"{args.turns}-turn image chat ({args.image_size}px JPEG, "
            f"{args.max_tokens} tokens a turn), {'+'.join(args.size)} model, "
            f"{args.rounds} rounds, "
            f"{os.cpu_count()} CPUs"
        )
        plot(medians, Path(args.plot), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
