"""Soak test: the real server under mixed requests on every door, watched
from outside.

Starts ``python -m mlx_pinned.server serve --demo`` (uvicorn, a free loopback
port, the tiny offline models), then sends mixed requests with bounded
concurrency, ``--requests`` of them or for ``--minutes``:

- ``plain``: a vision request, non-streaming, 4 to 32 tokens;
- ``stream``: the same, streamed, with usage; must end with ``[DONE]``;
- ``cancel``: a long stream the client drops after a few chunks;
- ``queued``: a request the client abandons after a few milliseconds, often
  while it still waits for the model;
- ``bad``: one of a list of invalid requests (bad base64, a local path, a
  remote URL, a wrong type, an unknown model, broken JSON, too many images);
  must be a 4xx in OpenAI's error shape;
- ``messages``: Anthropic's ``/v1/messages``, whole or streamed;
- ``responses``: ``/v1/responses`` stored, then a second turn chained to it
  by ``previous_response_id``;
- ``completion``: the legacy ``/v1/completions``;
- ``embedding``: ``/v1/embeddings`` of a few texts on the demo's embedding
  model;
- ``transcription``: ``/v1/audio/transcriptions`` of a second of audio on the
  demo's Whisper;
- ``speech``: ``/v1/audio/speech`` of a short sentence on the demo's
  Qwen3-TTS, in one of its formats, whole or streamed.

Anything else is an unexpected error: a 5xx, a wrong status, an error event in
a stream, a malformed body, a transport error outside the cancellations. While
it runs, the server process's resident memory and thread count are sampled
(psutil if installed, else /proc). At the end the server must be idle (no open
stream, nothing pending), and SIGINT must drain it and exit 0 with a log free
of tracebacks. Prints the figures; ``--json`` writes them too. Not for CI::

    python benchmarks/soak.py [--requests 1000 | --minutes 30]
        [--chat-model DIR] [--concurrency 16] [--seed 0] [--json OUT] [--plot PNG]
        [-- SERVER OPTIONS, e.g. --max-num-seqs 1]

With ``--minutes`` the RSS curve is the point: the summary gives its
growth over the last third of the run (``--plot`` draws it, with MLX's
active and cached bytes from ``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlx_pinned.server.cli import DEMO_MODEL_NAME, demo_name
from mlx_pinned.testing import image_data_uri

READY = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
KINDS = (
    "plain",
    "stream",
    "cancel",
    "queued",
    "bad",
    "messages",
    "responses",
    "completion",
    "embedding",
    "transcription",
    "speech",
)
WEIGHTS = (20, 15, 8, 5, 7, 12, 12, 9, 7, 5, 5)
# A second of a tone, for the transcription door.
_TONE = (
    b"RIFF" + (36 + 32000).to_bytes(4, "little") + b"WAVEfmt "
    + (16).to_bytes(4, "little") + (1).to_bytes(2, "little")
    + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little")
    + (32000).to_bytes(4, "little") + (2).to_bytes(2, "little")
    + (16).to_bytes(2, "little") + b"data" + (32000).to_bytes(4, "little")
    + bytes(range(256)) * 125
)  # fmt: skip


@dataclass
class Sample:
    at: float
    rss_mb: float
    threads: int
    mlx_active_mb: float = 0.0
    mlx_cache_mb: float = 0.0


@dataclass
class Report:
    requests: int = 0
    seconds: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle_after: dict[str, Any] = field(default_factory=dict)
    rested: Sample | None = None  # after --idle seconds without traffic
    server_statuses: dict[str, int] = field(default_factory=dict)  # /metrics
    held: dict[str, float] = field(default_factory=dict)  # /metrics, at the end
    exit_code: int | None = None
    log_problems: list[str] = field(default_factory=list)


def process_stats(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and thread count of ``pid``."""
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]
        threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
        return rss / 1024, threads
    process = psutil.Process(pid)
    return process.memory_info().rss / 2**20, process.num_threads()


def vision(max_tokens: int, seed: int, **extra: Any) -> dict[str, Any]:
    size = (32 + 16 * (seed % 4), 64 - 8 * (seed % 3))
    return {
        "model": DEMO_MODEL_NAME,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe this image in one sentence."},
                    {
                        "type": "image_url",
                        "image_url": {"url": image_data_uri(*size, seed=seed)},
                    },
                ],
            }
        ],
        "max_tokens": max_tokens,
        **extra,
    }


def bad_requests() -> list[tuple[str, bytes | dict[str, Any]]]:
    body = vision(4, 0)
    image = body["messages"][0]["content"][1]

    def with_url(url: str) -> dict[str, Any]:
        copy: dict[str, Any] = json.loads(json.dumps(body))
        copy["messages"][0]["content"][1]["image_url"]["url"] = url
        return copy

    return [
        ("bad base64", with_url("data:image/jpeg;base64,!!!")),
        (
            "not an image",
            with_url("data:image/png;base64," + base64.b64encode(b"x" * 99).decode()),
        ),
        ("local path", with_url("/etc/passwd")),
        ("file url", with_url("file:///etc/passwd")),
        ("remote url", with_url("http://169.254.169.254/latest/meta-data/")),
        ("wrong type", {**body, "temperature": "hot"}),
        ("out of range", {**body, "top_logprobs": 99, "logprobs": True}),
        ("unknown model", {**body, "model": "gpt-4o"}),
        ("broken json", b'{"model": "mlx-pinned-demo", "messages": ['),
        (
            "too many images",
            {**body, "messages": [{"role": "user", "content": [image] * 9}]},
        ),
    ]


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.report = Report()
        self.rng = random.Random(args.seed)
        self.bad = bad_requests()
        self.statuses: Counter[str] = Counter()

    def unexpected(self, kind: str, what: str) -> None:
        self.report.unexpected.append(f"{kind}: {what}"[:300])

    async def one(self, client: httpx.AsyncClient, i: int, kind: str) -> None:
        rng = random.Random(self.args.seed * 100_003 + i)
        url = f"{self.url}/v1/chat/completions"
        try:
            if kind == "plain":
                response = await client.post(url, json=vision(rng.randint(4, 32), i))
                self.statuses[f"{kind} {response.status_code}"] += 1
                if response.status_code != 200:
                    self.unexpected(kind, f"{response.status_code} {response.text}")
                elif response.json()["choices"][0]["finish_reason"] is None:
                    self.unexpected(kind, response.text)
            elif kind == "stream":
                body = vision(rng.randint(4, 32), i, stream=True)
                body["stream_options"] = {"include_usage": True}
                async with client.stream("POST", url, json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                self.statuses[f"{kind} {response.status_code}"] += 1
                if response.status_code != 200 or lines[-1] != "data: [DONE]":
                    self.unexpected(kind, f"{response.status_code} {lines[-2:]}")
                elif any('"error"' in line for line in lines):
                    self.unexpected(kind, "an error event")
            elif kind == "cancel":
                body = vision(2000, i, stream=True)
                async with client.stream("POST", url, json=body) as response:
                    self.statuses[f"{kind} {response.status_code}"] += 1
                    if response.status_code != 200:
                        self.unexpected(kind, str(response.status_code))
                        return
                    seen = 0
                    async for line in response.aiter_lines():
                        seen += bool(line)
                        if seen >= rng.randint(1, 5):
                            break  # the client walks away mid-stream
            elif kind == "queued":
                self.statuses[f"{kind} sent"] += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        client.post(url, json=vision(16, i)),
                        timeout=rng.uniform(0.001, 0.03),
                    )
            elif kind in DOORS:
                await DOORS[kind](self, client, rng, i)
            else:
                name, bad = self.bad[i % len(self.bad)]
                if isinstance(bad, bytes):
                    response = await client.post(url, content=bad)
                else:
                    response = await client.post(url, json=bad)
                self.statuses[f"{kind} {response.status_code}"] += 1
                error = response.json().get("error", {})
                if not (400 <= response.status_code < 500) or set(error) != {
                    "message",
                    "type",
                    "param",
                    "code",
                }:
                    self.unexpected(kind, f"{name}: {response.status_code}")
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            self.unexpected(kind, repr(exc))

    def check(self, kind: str, response: httpx.Response) -> Any:
        """Count the answer; its JSON if it is a 200, else None."""
        self.statuses[f"{kind} {response.status_code}"] += 1
        if response.status_code != 200:
            self.unexpected(kind, f"{response.status_code} {response.text}")
            return None
        return response.json()

    async def run(self, pid: int) -> None:
        args = self.args
        counts: Counter[str] = Counter()
        done = asyncio.Event()

        async def sample(client: httpx.AsyncClient) -> None:
            start = time.perf_counter()
            every = 0.25 if args.minutes is None else 5.0
            while True:
                rss, threads = process_stats(pid)
                active, cached = await mlx_memory(client, self.url)
                self.report.samples.append(
                    Sample(time.perf_counter() - start, rss, threads, active, cached)
                )
                if done.is_set():
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), every)

        limits = httpx.Limits(max_connections=args.concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            start = time.perf_counter()
            stop = None if args.minutes is None else start + args.minutes * 60
            sent = 0

            def more() -> bool:
                if stop is None:
                    return sent < args.requests
                return time.perf_counter() < stop

            async def worker() -> None:
                nonlocal sent
                while more():
                    i, sent = sent, sent + 1
                    kind = random.Random(args.seed * 7919 + i).choices(KINDS, WEIGHTS)[
                        0
                    ]
                    counts[kind] += 1
                    await self.one(client, i, kind)

            async def mark() -> None:  # --trace: the start of the growth traced
                await asyncio.sleep((args.minutes or 0) * 20)
                os.kill(pid, signal.SIGUSR1)

            sampler = asyncio.create_task(sample(client))
            marker = asyncio.create_task(mark()) if args.trace else None
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            self.report.seconds = time.perf_counter() - start
            if marker is not None:
                await marker
                os.kill(pid, signal.SIGUSR1)  # where the growth since is held
            self.report.by_kind = dict(counts)
            args.requests = sent
            # Cancelled work is closed on the MLX thread within a token or two.
            deadline = time.monotonic() + 10
            while True:
                health = (await client.get(f"{self.url}/health")).json()
                idle = health["open_streams"] == 0 and health["pending"] == 0
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            self.report.idle_after = health
            metrics = (await client.get(f"{self.url}/metrics")).text
            self.report.held = holders(metrics)
            for status, count in re.findall(
                r'requests_total\{route="/v1/chat/completions",status="(\d+)"\} '
                r"([\d.]+)",
                metrics,
            ):
                self.report.server_statuses[status] = int(float(count))
            if not idle:
                self.unexpected("idle", f"still busy after the load: {health}")
            done.set()
            await sampler
            # anyio's worker threads (image decoding) retire after 10 s idle.
            await asyncio.sleep(args.idle)
            rss, threads = process_stats(pid)
            self.report.rested = Sample(time.perf_counter() - start, rss, threads)
        self.report.requests = args.requests
        self.report.statuses = dict(sorted(self.statuses.items()))


async def messages(soak: Soak, client: httpx.AsyncClient, rng: Any, i: int) -> None:
    body = {
        "model": DEMO_MODEL_NAME,
        "max_tokens": rng.randint(4, 32),
        "messages": [{"role": "user", "content": f"Say something {i}."}],
    }
    url = f"{soak.url}/v1/messages"
    if rng.random() < 0.5:
        answer = soak.check("messages", await client.post(url, json=body))
        if answer is not None and answer.get("type") != "message":
            soak.unexpected("messages", str(answer)[:200])
        return
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        lines = [line async for line in response.aiter_lines() if line]
    soak.statuses[f"messages-stream {response.status_code}"] += 1
    if response.status_code != 200 or "message_stop" not in lines[-1]:
        soak.unexpected("messages-stream", f"{response.status_code} {lines[-2:]}")


async def responses(soak: Soak, client: httpx.AsyncClient, rng: Any, i: int) -> None:
    url = f"{soak.url}/v1/responses"
    body = {
        "model": DEMO_MODEL_NAME,
        "input": f"Tell me about {i}.",
        "max_output_tokens": rng.randint(4, 24),
        "store": True,
    }
    first = soak.check("responses", await client.post(url, json=body))
    if first is None:
        return
    chained = {**body, "input": "And then?", "previous_response_id": first["id"]}
    soak.check("responses-chained", await client.post(url, json=chained))


async def completion(soak: Soak, client: httpx.AsyncClient, rng: Any, i: int) -> None:
    body = {
        "model": DEMO_MODEL_NAME,
        "prompt": f"Once upon a time {i}",
        "max_tokens": rng.randint(4, 32),
    }
    soak.check("completion", await client.post(f"{soak.url}/v1/completions", json=body))


async def embedding(soak: Soak, client: httpx.AsyncClient, rng: Any, i: int) -> None:
    body = {
        "model": demo_name("embedding"),
        "input": [f"a sentence {i} {n}" for n in range(rng.randint(1, 8))],
    }
    soak.check("embedding", await client.post(f"{soak.url}/v1/embeddings", json=body))


async def transcription(
    soak: Soak, client: httpx.AsyncClient, rng: Any, i: int
) -> None:
    response = await client.post(
        f"{soak.url}/v1/audio/transcriptions",
        data={"model": demo_name("transcription"), "temperature": "0.2"},
        files={"file": ("tone.wav", _TONE, "audio/wav")},
    )
    soak.check("transcription", response)


async def speech(soak: Soak, client: httpx.AsyncClient, rng: Any, i: int) -> None:
    body = {
        "model": demo_name("speech"),
        "voice": rng.choice(("ryan", "serena", "vivian")),
        "input": f"Hello, number {i}.",
        "response_format": rng.choice(("mp3", "opus", "flac", "wav", "pcm")),
    }
    if body["response_format"] in ("opus", "wav", "pcm") and rng.random() < 0.5:
        body["stream_format"] = "audio"
    response = await client.post(f"{soak.url}/v1/audio/speech", json=body)
    soak.statuses[f"speech {response.status_code}"] += 1
    if response.status_code != 200 or not response.content:
        soak.unexpected("speech", f"{response.status_code} {response.text[:200]}")


DOORS = {
    "messages": messages,
    "responses": responses,
    "completion": completion,
    "embedding": embedding,
    "transcription": transcription,
    "speech": speech,
}


async def mlx_memory(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """MLX's active and cached MiB, from the server's ``/metrics``."""
    try:
        text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return 0.0, 0.0
    found = {
        name: float(value) / 2**20
        for name, value in re.findall(
            r"^mlx_pinned_mlx_(active|cache)_bytes ([\d.e+]+)$", text, re.M
        )
    }
    return found.get("active", 0.0), found.get("cache", 0.0)


#: What holds memory, as /metrics says (summed over the models).
HOLDERS = (
    "mlx_active_bytes",
    "prompt_cache_bytes",
    "image_cache_bytes",
    "kv_cache_bytes",
    "responses_store_bytes",
    "responses_store_items",
)


def holders(metrics: str) -> dict[str, float]:
    """Each of :data:`HOLDERS`, summed over its labels."""
    held = dict.fromkeys(HOLDERS, 0.0)
    for name, value in re.findall(
        r"^mlx_pinned_(\w+?)(?:\{[^}]*\})? ([\d.e+]+)$", metrics, re.M
    ):
        if name in held:
            held[name] += float(value)
    return held


def growth(samples: list[Sample]) -> float:
    """RSS growth over the last third of the run, as a share of its start."""
    if len(samples) < 3:
        return 0.0
    tail = samples[len(samples) * 2 // 3 :]
    return (tail[-1].rss_mb - tail[0].rss_mb) / tail[0].rss_mb


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.at / 60 for s in report.samples]
    figure, axes = plt.subplots(figsize=(8, 4))
    axes.plot(minutes, [s.rss_mb for s in report.samples], label="server RSS")
    axes.plot(minutes, [s.mlx_active_mb for s in report.samples], label="MLX active")
    axes.plot(minutes, [s.mlx_cache_mb for s in report.samples], label="MLX cache")
    axes.set_xlabel("minutes")
    axes.set_ylabel("MiB")
    axes.set_ylim(bottom=0)
    axes.legend()
    axes.set_title(f"soak: {report.requests} requests, every door")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def demo_config(log: Path, chat_model: Path) -> Path:
    """A config file beside ``log``: the demo's models and names, with
    ``chat_model`` as the chat one."""
    from mlx_pinned.server.kinds import KINDS as MODEL_KINDS

    tables = []
    for kind in MODEL_KINDS.values():
        if kind.demo is None:
            continue
        path = chat_model if kind.name == "chat" else kind.demo()
        tables.append(
            f'[[models]]\npath = "{path}"\nname = "{demo_name(kind.name)}"\n'
            f'model_kind = "{kind.name}"\n'
        )
    config = log.with_suffix(".toml")
    config.write_text("\n".join(tables))
    return config


def start_server(
    log: Path, args: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], str]:
    serve = ["-m", "mlx_pinned.server"]
    if args.trace is not None:  # Python's allocations traced
        os.environ["SOAK_TRACE"] = str(args.trace)
        serve = [str(Path(__file__).with_name("_traced_serve.py"))]
    command = [sys.executable, *serve, "serve", "--demo"]
    if args.chat_model is not None:  # the demo's models, this chat model
        command[-1:] = ["--config", str(demo_config(log, args.chat_model))]
    command += ["--port", "0", "--max-pending", str(args.max_pending)]
    command += args.server_args
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while (match := READY.search(log.read_text(errors="replace"))) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return process, match.group(1)


def summary(report: Report) -> str:
    samples = report.samples
    rss = [s.rss_mb for s in samples]
    threads = [s.threads for s in samples]

    def at(share: float) -> Sample:
        return samples[min(len(samples) - 1, int(len(samples) * share))]

    marks = [(f"{int(share * 100)}%", at(share)) for share in (0.1, 0.5, 0.9)]
    lines = [
        f"requests: {report.requests} in {report.seconds:.1f} s "
        f"({report.requests / report.seconds:.1f} req/s)",
        "kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(report.by_kind.items())),
        "statuses: " + ", ".join(f"{k}: {n}" for k, n in report.statuses.items()),
        "server's /metrics, chat requests by status: "
        + ", ".join(f"{k}: {n}" for k, n in sorted(report.server_statuses.items())),
        f"unexpected errors: {len(report.unexpected)}",
        *(f"  {u}" for u in report.unexpected[:10]),
        f"server RSS MiB: start {rss[0]:.1f}, "
        + ", ".join(f"{name} {s.rss_mb:.1f}" for name, s in marks)
        + f", peak {max(rss):.1f}, end {rss[-1]:.1f}; "
        f"the last third grew {growth(samples) * 100:.1f} %",
        f"MLX MiB at the end: active {samples[-1].mlx_active_mb:.1f}, "
        f"cache {samples[-1].mlx_cache_mb:.1f}",
        "held at the end (/metrics): "
        + ", ".join(
            f"{name} {value:.0f}"
            if name.endswith("items")
            else f"{name[:-6]} {value / 2**20:.1f} MiB"
            for name, value in report.held.items()
        ),
        f"server threads: start {threads[0]}, "
        + ", ".join(f"{name} {s.threads}" for name, s in marks)
        + f", peak {max(threads)}, end {threads[-1]}",
        f"after {report.rested.at - report.seconds:.0f} s idle: "
        f"RSS {report.rested.rss_mb:.1f} MiB, {report.rested.threads} threads"
        if report.rested
        else "",
        f"idle after the load: {report.idle_after}",
        f"SIGINT: exit code {report.exit_code}; log problems: "
        f"{report.log_problems or 'none'}",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--minutes", type=float, help="send for this long instead of --requests"
    )
    parser.add_argument("--plot", type=Path, help="draw the RSS curve here (PNG)")
    parser.add_argument(
        "--trace",
        type=Path,
        help="trace the server's Python allocations: where those made after "
        "the first third of the run are held, written here at the end",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-pending", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--idle",
        type=float,
        default=12.0,
        help="seconds to rest before the last sample",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--chat-model", type=Path, help="serve this chat model (default: the demo's)"
    )
    parser.add_argument(
        "server_args",
        nargs="*",
        help="more options for the server, after --: -- --max-num-seqs 1",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        process, url = start_server(log, args)
        soak = Soak(url, args)
        try:
            asyncio.run(soak.run(process.pid))
        finally:
            process.send_signal(signal.SIGINT)
            try:
                soak.report.exit_code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        text = log.read_text(errors="replace")
        report = soak.report
        for needle in ("Traceback", " ERROR ", "There is no Stream"):
            if needle in text:
                report.log_problems.append(needle)
        fives = re.findall(r"POST /v1/\S+ (5\d\d) ", text)
        if fives:
            report.log_problems.append(f"{len(fives)} 5xx in the log")
    print(summary(report))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    ok = not report.unexpected and report.exit_code == 0 and not report.log_problems
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
