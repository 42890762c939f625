"""Load generators against a real server: guidellm and NVIDIA's aiperf,
each a concurrent run in which no request errors and every request returns
exactly the output tokens that it asked for. Both ask with vLLM's fields
(guidellm ``ignore_eos``; aiperf ``ignore_eos`` on chat and ``min_tokens``
on completions, through ``--extra-inputs``), so the model here ends every
turn at once unless those fields are honoured.

Each lives in a venv of its own that ``.ci/run`` makes at a pinned version
in the cache folder (``guidellm-<version>``: it brings torch;
``aiperf-<version>``: its pins clash with the main venv's); under
``CI=true`` a missing one fails its test, elsewhere it skips it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_pinned.server.engine.rows import end_of_turn_ids
from mlx_pinned.testing import tiny_lm_path

from .conftest import MODEL, sse_events
from .kit import Serve, Server, running

CACHE = Path(os.environ.get("MLX_PINNED_CACHE", Path.home() / ".cache" / "mlx-pinned"))
#: guidellm at the version FACTS.md measured; .ci/run installs it here.
GUIDELLM_VERSION = "0.8.1"
GUIDELLM = CACHE / f"guidellm-{GUIDELLM_VERSION}" / "bin" / "guidellm"
#: aiperf at the version docs/testing.md measured; .ci/run installs it here.
AIPERF_VERSION = "0.13.0"
AIPERF = CACHE / f"aiperf-{AIPERF_VERSION}" / "bin" / "aiperf"
CI_RUN = Path(__file__).parents[2] / ".ci" / "run"
STREAMS, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 12, 32, 16
#: What aiperf's completions run asks for with vLLM's ``min_tokens``.
MIN_TOKENS = 8
#: The body of a request of guidellm's run (from its JSON, ``request_args``).
GUIDELLM_BODY: dict[str, Any] = {
    "model": MODEL,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_completion_tokens": OUTPUT_TOKENS,
    "ignore_eos": True,
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "1 0 m0 Finish"}]}
    ],
}
#: The bodies of aiperf's requests (from its ``inputs.json``): chat,
#: streamed, with ``--extra-inputs ignore_eos:true``; completions, whole,
#: with ``--extra-inputs min_tokens:8``.
AIPERF_CHAT_BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": " According to the honour of"}],
    "model": MODEL,
    "stream": True,
    "max_completion_tokens": OUTPUT_TOKENS,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}
AIPERF_COMPLETIONS_BODY: dict[str, Any] = {
    "prompt": " According to the honour of",
    "model": MODEL,
    "stream": False,
    "max_tokens": OUTPUT_TOKENS,
    "min_tokens": MIN_TOKENS,
}
#: The server's log line of one finished request: route, status, streamed,
#: tokens generated, finish reason.
SERVED = re.compile(
    r"POST (/v1/\S+) (\d+) stream=(\d) .* completion=(\d+) .* finish=(\w+)"
)


@pytest.mark.parametrize(
    ("name", "version", "binary"),
    [("GUIDELLM", GUIDELLM_VERSION, GUIDELLM), ("AIPERF", AIPERF_VERSION, AIPERF)],
)
def test_ci_installs_the_version_this_test_runs(
    name: str, version: str, binary: Path
) -> None:
    script = CI_RUN.read_text()
    assert f"\n{name}_VERSION={version}\n" in script
    # The folder the test reads is the one .ci/run makes.
    assert f"/{binary.parents[1].name.split('-')[0]}-${name}_VERSION" in script


@pytest.mark.anyio
async def test_guidellm_request_with_the_end_forced_gets_every_token(
    serve: Serve,
) -> None:
    async with serve() as served:
        bias = {str(end_of_turn_ids(served.model)[0]): 100.0}
        reply = await served.chat({**GUIDELLM_BODY, "logit_bias": bias})
    assert reply.status_code == 200, reply.text
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]  # the chunk guidellm counts from
    assert usage["completion_tokens"] == OUTPUT_TOKENS
    finishes = [c["finish_reason"] for e in events[:-2] for c in e["choices"]]
    assert [f for f in finishes if f] == ["length"]


@pytest.mark.anyio
async def test_aiperf_requests_with_the_end_forced_get_every_asked_token(
    serve: Serve,
) -> None:
    async with serve() as served:
        bias = {str(end_of_turn_ids(served.model)[0]): 100.0}
        chat = await served.chat({**AIPERF_CHAT_BODY, "logit_bias": bias})
        legacy = await served.client.post(
            "/v1/completions", json={**AIPERF_COMPLETIONS_BODY, "logit_bias": bias}
        )
    assert chat.status_code == 200, chat.text
    events = sse_events(chat.text)
    assert events[-2]["usage"]["completion_tokens"] == OUTPUT_TOKENS
    assert legacy.status_code == 200, legacy.text
    reply = legacy.json()
    assert reply["usage"]["completion_tokens"] == MIN_TOKENS
    # The end of turn, held off until min_tokens, ended it then.
    (choice,) = reply["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)


def installed(binary: Path, version: str) -> Path:
    """``binary``, where .ci/run installs it; missing, the test fails under
    ``CI=true`` and skips elsewhere."""
    if not binary.exists():
        message = f"{binary.name} {version} is not installed at {binary} "
        message += "(.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def ending_model(folder: Path) -> Path:
    """The tiny text model, made to pick an end-of-turn token at every step
    whatever it is given: its layers add nothing to the residual stream, and
    every embedding (tied to the output) is the same vector but the
    end-of-turn tokens', which are twice it, so their logit is twice the
    others' (64 more, after the final norm of ones)."""
    import mlx.core as mx

    shutil.copytree(tiny_lm_path(), folder)
    path = folder / "model.safetensors"
    weights = mx.load(str(path))
    assert isinstance(weights, dict)
    ends = json.loads((folder / "generation_config.json").read_text())
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    embed = "language_model.model.embed_tokens.weight"
    rows = mx.ones_like(weights[embed])
    rows[mx.array(ends["eos_token_id"])] = 2.0
    weights[embed] = rows
    norm = "language_model.model.norm.weight"
    weights[norm] = mx.ones_like(weights[norm])
    mx.save_safetensors(str(path), weights)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_concurrent_guidellm_run_gets_every_asked_token(tmp_path: Path) -> None:
    binary = installed(GUIDELLM, GUIDELLM_VERSION)
    model = ending_model(tmp_path / "ending")
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", str(model)]
    command += ["--served-model-name", MODEL, "--port", "0"]
    with running(command, tmp_path / "server.log") as server:
        report = run_guidellm(binary, server, model, tmp_path)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        log = server.log_text()

    assert report["metadata"]["guidellm_version"] == GUIDELLM_VERSION
    (benchmark,) = report["benchmarks"]
    assert benchmark["config"]["strategy"]["streams"] == STREAMS
    requests = benchmark["requests"]
    assert [r["info"]["error"] for r in requests["errored"]] == []
    assert requests["incomplete"] == []
    done = requests["successful"]
    assert len(done) == REQUESTS
    for stats in done:
        body = json.loads(stats["request_args"])["body"]
        assert body["ignore_eos"] is True
        assert body["max_completion_tokens"] == OUTPUT_TOKENS
        assert stats["output_tokens"] == OUTPUT_TOKENS, stats["output"]
    # guidellm kept its 4 streams in flight at once.
    assert benchmark["metrics"]["request_concurrency"]["successful"]["max"] == STREAMS

    served = SERVED.findall(log)
    route = "/v1/chat/completions"
    assert served == [(route, "200", "1", str(OUTPUT_TOKENS), "length")] * REQUESTS
    chat = 'mlx_pinned_requests_total{route="/v1/chat/completions",status="200"}'
    assert f"{chat} {float(REQUESTS)}" in metrics
    tokens = "mlx_pinned_generated_tokens_total"
    tokens += f'{{api="chat_completions",model="{MODEL}"}}'
    assert f"{tokens} {float(REQUESTS * OUTPUT_TOKENS)}" in metrics


def run_guidellm(
    binary: Path, server: Server, model: Path, tmp_path: Path
) -> dict[str, Any]:
    """guidellm's concurrent profile on synthetic prompts, to its JSON report;
    it reads the prompts' tokenizer from the model's folder, offline."""
    output = tmp_path / "guidellm.json"
    done = subprocess.run(
        [
            str(binary),
            "run",
            f"--backend=kind=openai_http,target={server.url},model={MODEL}",
            f"--profile=kind=concurrent,streams={STREAMS}",
            f"--data=kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
            f"output_tokens={OUTPUT_TOKENS}",
            f"--tokenizer=kind=huggingface_auto,model={model}",
            f"--constraint=kind=max_requests,count={REQUESTS}",
            f"--output=kind=json,path={output}",
            "--disable-console",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report: dict[str, Any] = json.loads(output.read_text())
    return report


def hub_cache(model: Path, home: Path) -> Path:
    """An ``HF_HOME`` whose hub cache holds ``model``'s tokenizer as the
    repository ``mlx-pinned/tiny``: under ``HF_HUB_OFFLINE`` aiperf 0.13.0
    looks a tokenizer up in the cache only (a folder's path is taken for a
    repository's name there, and refused)."""
    repo = home / "hub" / "models--mlx-pinned--tiny"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return home


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_concurrent_aiperf_runs_get_every_asked_token(tmp_path: Path) -> None:
    binary = installed(AIPERF, AIPERF_VERSION)
    model = ending_model(tmp_path / "ending")
    home = hub_cache(model, tmp_path / "hf")
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", str(model)]
    command += ["--served-model-name", MODEL, "--port", "0"]
    with running(command, tmp_path / "server.log") as server:
        runs = {
            "chat": run_aiperf(
                binary, server, home, tmp_path / "chat", "chat", "--streaming",
                "--extra-inputs", "ignore_eos:true",
            ),
            "completions": run_aiperf(
                binary, server, home, tmp_path / "completions", "completions",
                "--extra-inputs", f"min_tokens:{MIN_TOKENS}",
            ),
        }  # fmt: skip
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        log = server.log_text()

    # What each run asked for, in every body it sent, and what it got.
    asked = {
        "chat": {"ignore_eos": True, "max_completion_tokens": OUTPUT_TOKENS},
        "completions": {"min_tokens": MIN_TOKENS, "max_tokens": OUTPUT_TOKENS},
    }
    got = {"chat": OUTPUT_TOKENS, "completions": MIN_TOKENS}
    for endpoint, (summary, records, bodies) in runs.items():
        fields = asked[endpoint]
        assert [{k: b.get(k) for k in fields} for b in bodies] == [fields] * REQUESTS
        assert summary["aiperf_version"] == AIPERF_VERSION
        assert summary["error_summary"] == []
        assert summary["request_count"]["avg"] == REQUESTS
        assert [r["error"] for r in records if "error" in r] == []
        assert len(records) == REQUESTS
        # Counted from the usage and by aiperf's own tokenizer alike.
        expected = {"value": got[endpoint], "unit": "tokens"}
        for record in records:
            measured = record["metrics"]
            assert measured["usage_completion_tokens"] == expected
            assert measured["output_token_count"] == expected
        # aiperf kept its 4 requests in flight at once.
        assert in_flight(records) == STREAMS

    served = SERVED.findall(log)
    chat = ("/v1/chat/completions", "200", "1", str(OUTPUT_TOKENS), "length")
    legacy = ("/v1/completions", "200", "0", str(MIN_TOKENS), "stop")
    assert served == [chat] * REQUESTS + [legacy] * REQUESTS, log
    for route, api, each in (
        ("/v1/chat/completions", "chat_completions", OUTPUT_TOKENS),
        ("/v1/completions", "completions", MIN_TOKENS),
    ):
        requests = f'mlx_pinned_requests_total{{route="{route}",status="200"}}'
        assert f"{requests} {float(REQUESTS)}" in metrics
        generated = f'mlx_pinned_generated_tokens_total{{api="{api}",model="{MODEL}"}}'
        assert f"{generated} {float(REQUESTS * each)}" in metrics


def in_flight(records: list[dict[str, Any]]) -> int:
    """The most requests that were in flight at once (from each record's
    start and end)."""
    edges = []
    for record in records:
        meta = record["metadata"]
        edges += [(meta["request_start_ns"], 1), (meta["request_end_ns"], -1)]
    most = now = 0
    for _, step in sorted(edges):
        now += step
        most = max(most, now)
    return most


def run_aiperf(
    binary: Path, server: Server, home: Path, out: Path, endpoint: str, *extra: str
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """aiperf's concurrency profile on synthetic prompts: its summary, its
    per-request records and the bodies it sent (its own files). It counts
    tokens with the model's tokenizer, from ``home``'s hub cache, offline."""
    done = subprocess.run(
        [
            str(binary),
            "profile",
            f"--model={MODEL}",
            f"--url={server.url}",
            f"--endpoint-type={endpoint}",
            "--tokenizer=mlx-pinned/tiny",
            f"--concurrency={STREAMS}",
            f"--request-count={REQUESTS}",
            f"--isl={PROMPT_TOKENS}",
            f"--osl={OUTPUT_TOKENS}",
            "--random-seed=1",
            f"--artifact-dir={out}",
            "--export-level=records",
            "--ui-type=none",
            "--workers-max=2",
            "--record-processors=1",
            "--no-gpu-telemetry",
            "--no-server-metrics",
            *extra,
        ],
        env={
            **os.environ,
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        },
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary: dict[str, Any] = json.loads(
        (out / "profile_export_aiperf.json").read_text()
    )
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    inputs = json.loads((out / "inputs.json").read_text())
    bodies = [p for entry in inputs["data"] for p in entry["payloads"]]
    return summary, records, bodies
