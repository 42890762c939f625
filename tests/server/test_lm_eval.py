"""lm-eval (pinned in the test extra) against a live server: its
``local-completions`` model on a multiple-choice task and a
rolling-loglikelihood (perplexity) task, both from task files in this repo
(``lm_eval_tasks/``, offline JSON data). Every loglikelihood lm-eval reports
must equal the same sum computed in process with one forward pass of the
model; that is what ``echo`` with ``logprobs`` is for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import LoadedModel, load
from mlx_pinned.testing import tiny_vlm_path

from .kit import Serve, running_server

TASKS = Path(__file__).parent / "lm_eval_tasks"
REPO = Path(__file__).parents[2]
LM_EVAL = "0.4.13"
# Sums of a few dozen tokens, each within 1e-4 of the in-process pass.
EXACT = 1e-3


def rows(name: str) -> list[dict[str, Any]]:
    lines = (TASKS / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_the_pinned_lm_eval_and_its_offline_tasks_are_here() -> None:
    assert metadata.version("lm-eval") == LM_EVAL
    for name in ("tiny_choice", "tiny_text"):
        task = (TASKS / f"{name}.yaml").read_text()
        assert f"tests/server/lm_eval_tasks/{name}.jsonl" in task
        assert rows(name)


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's per-sample answers of both tasks, from one run."""
    folder = tmp_path_factory.mktemp("lm_eval")
    with running_server(folder / "server.log") as server:
        args = ",".join(
            [
                "model=mlx-pinned-demo",
                f"base_url={server.url}/v1/completions",
                f"tokenizer={tiny_vlm_path()}",
                "num_concurrent=2",
                "max_retries=1",
                "tokenized_requests=True",
            ]
        )
        command = [str(Path(sys.executable).with_name("lm_eval")), "run"]
        command += ["--model", "local-completions", "--model_args", args]
        command += ["--tasks", "tiny_choice,tiny_text", "--include_path", str(TASKS)]
        command += ["--output_path", str(folder / "out"), "--log_samples"]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        run = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-4000:] + server.log_text()[-2000:]
    found: dict[str, Any] = {}
    for path in (folder / "out").rglob("samples_*.jsonl"):
        task = path.name.split("_2")[0].removeprefix("samples_")
        found[task] = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(found) == {"tiny_choice", "tiny_text"}
    return found


@pytest.fixture(scope="module")
def model(thread: MLXThread) -> LoadedModel:
    return thread.run_sync(load, tiny_vlm_path())


def summed(
    thread: MLXThread, model: LoadedModel, context: Sequence[int], rest: Sequence[int]
) -> tuple[float, bool]:
    """The log-probability of ``rest`` after ``context`` in one forward pass
    in process, and whether each of its tokens is the greedy one."""

    def run() -> tuple[float, bool]:
        ids = [*context, *rest]
        logits = model.model.language_model(mx.array([ids])).logits[0]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        start = len(context) - 1
        picked = logprobs[start : start + len(rest)]
        chosen = mx.take_along_axis(picked, mx.array(rest)[:, None], axis=-1)
        greedy = mx.argmax(picked, axis=-1).tolist() == list(rest)
        return float(mx.sum(chosen).item()), greedy

    return thread.run_sync(run)


def encode(model: LoadedModel, text: str) -> list[int]:
    """lm-eval's encoding (its Hugging Face backend: no special tokens)."""
    return list(model.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.slow
def test_multiple_choice_loglikelihoods_equal_the_forward_pass(
    samples: dict[str, Any], thread: MLXThread, model: LoadedModel
) -> None:
    answers = samples["tiny_choice"]
    assert len(answers) == len(rows("tiny_choice"))
    for sample in answers:
        for arguments, (value, greedy) in zip(
            sample["arguments"].values(), sample["filtered_resps"], strict=True
        ):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            # lm-eval's split of the pair: the continuation's tokens are the
            # whole text's past the context's.
            whole = encode(model, context + continuation)
            head = encode(model, context)
            expected, expected_greedy = summed(thread, model, head, whole[len(head) :])
            assert float(value) == pytest.approx(expected, abs=EXACT)
            assert (greedy == "True") == expected_greedy


@pytest.mark.slow
def test_rolling_loglikelihoods_equal_the_forward_pass(
    samples: dict[str, Any], thread: MLXThread, model: LoadedModel
) -> None:
    answers = samples["tiny_text"]
    assert len(answers) == len(rows("tiny_text"))
    # One window per short document, after lm-eval's prefix token (its EOT).
    prefix = model.tokenizer.eos_token_id
    for sample in answers:
        text = sample["doc"]["text"]
        expected, _ = summed(thread, model, [prefix], encode(model, text))
        assert float(sample["filtered_resps"][0]) == pytest.approx(expected, abs=EXACT)


@pytest.mark.anyio
async def test_lm_evals_request_shape_is_served_in_process(serve: Serve) -> None:
    # The request lm-eval sends, without lm-eval: what the slow tests rely on.
    body = {
        "model": "tiny",
        "prompt": [[283, 228, 330, 80]],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
    }
    async with serve() as served:
        response = await served.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 5
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
