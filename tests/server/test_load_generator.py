"""guidellm, the load generator, against a real server: a concurrent run in
which no request errors and every request returns exactly the output tokens
that it asked for. guidellm asks with vLLM's ``ignore_eos``, so the model
here ends every turn at once unless that field is honoured.

guidellm brings torch, so it lives in a venv of its own that ``.ci/run``
makes at a pinned version in the cache folder (``guidellm-<version>``);
under ``CI=true`` a missing one fails the test, elsewhere it skips it."""

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

from mlx_pinned.server.engine.admission import end_of_turn_ids
from mlx_pinned.testing import tiny_lm_path

from .conftest import MODEL, sse_events
from .kit import Serve, Server, running

#: guidellm at the version FACTS.md measured; .ci/run installs it here.
GUIDELLM_VERSION = "0.8.1"
GUIDELLM = (
    Path(os.environ.get("MLX_PINNED_CACHE", Path.home() / ".cache" / "mlx-pinned"))
    / f"guidellm-{GUIDELLM_VERSION}"
    / "bin"
    / "guidellm"
)
CI_RUN = Path(__file__).parents[2] / ".ci" / "run"
STREAMS, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 12, 32, 16
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
#: The server's log line of one finished request.
SERVED = re.compile(
    r"POST /v1/chat/completions (\d+) stream=1 .* completion=(\d+) .* finish=(\w+)"
)


def test_ci_installs_the_version_this_test_runs() -> None:
    script = CI_RUN.read_text()
    assert f"\nGUIDELLM_VERSION={GUIDELLM_VERSION}\n" in script
    assert "/guidellm-$GUIDELLM_VERSION" in script  # the folder GUIDELLM names


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


def guidellm() -> Path:
    if not GUIDELLM.exists():
        message = f"guidellm {GUIDELLM_VERSION} is not installed at {GUIDELLM} "
        message += "(.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return GUIDELLM


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
    binary = guidellm()
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
    assert served == [("200", str(OUTPUT_TOKENS), "length")] * REQUESTS, log
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
