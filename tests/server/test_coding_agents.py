"""Coding agents from npm against ``serve MODEL`` with the server's defaults:
qwen-code, opencode and pi, each at a pinned version (``.ci/run`` installs
them into the cache folder), each asking for its own default output limit
(8000, 32000 and 16384 tokens). Their system prompts and tools are trimmed
where the defaults are tens of thousands of the tiny tokenizer's tokens,
which take minutes to prefill on a CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_pinned.server import create_app
from mlx_pinned.testing import tiny_vlm_path

from .kit import Lifespan, Served, Server, in_process, running

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
#: What the model answers, whatever it is asked (qwen-code takes an empty
#: answer for an error).
WORD = "Hello"
NPM_CACHE = (
    Path(os.environ.get("MLX_PINNED_CACHE", Path.home() / ".cache" / "mlx-pinned"))
    / "npm"
)
#: (folder in the cache, npm package, version, command), as FACTS.md measured.
QWEN_CODE = ("qwen-code", "@qwen-code/qwen-code", "0.15.10", "qwen")
OPENCODE = ("opencode", "opencode-ai", "1.18.33", "opencode")
PI = ("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi")
#: A request's line in the server's log: method, route, status.
SERVED = re.compile(r" (GET|POST|PUT|DELETE|HEAD|OPTIONS) (\S+) (\d{3}) ")


def installed(agent: tuple[str, str, str, str]) -> Path:
    """The agent's command where ``.ci/run`` installs it; missing, its test
    fails under ``CI=true`` and skips elsewhere, saying how to install it."""
    folder, package, version, command = agent
    prefix = NPM_CACHE / f"{folder}-{version}"
    binary = prefix / "node_modules" / ".bin" / command
    if not binary.exists():
        message = f"{package} {version} is not installed at {binary}: run "
        message += f"npm install --prefix {prefix} {package}@{version} (as .ci/run)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def speaking_model(folder: Path, text: str) -> Path:
    """The tiny model, made to answer ``text`` and end its turn whatever it
    is asked, greedy or not: its layers add nothing to the residual stream,
    so a step's logits depend on its input token alone; each of the text's
    tokens has an embedding of its own, which the (untied) output head maps
    to the token after it (the last one's to the end of turn), and any other
    token's to the text's first."""
    import mlx.core as mx
    import numpy as np
    from tokenizers import Tokenizer

    shutil.copytree(tiny_vlm_path(), folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(set(ids)) == len(ids), f"{text!r} repeats a token"
    end = tokenizer.token_to_id("<|im_end|>")
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    text_model = "language_model.model."
    for name in list(weights):
        if name.startswith(text_model) and name.endswith(
            ("o_proj.weight", "down_proj.weight")
        ):
            weights[name] = mx.zeros_like(weights[name])
    vocab, width = weights[text_model + "embed_tokens.weight"].shape
    embed = np.zeros((vocab, width), np.float32)
    embed[:, 0] = 1.0
    head = np.zeros((vocab, width), np.float32)
    for state, token in enumerate(ids):
        embed[token] = np.eye(width)[state + 1]
        head[token, state] = 1.0
    head[end, len(ids)] = 1.0
    # Logits of 0 or 80 after the final norm: no temperature picks another.
    weights[text_model + "embed_tokens.weight"] = mx.array(embed)
    weights["language_model.lm_head.weight"] = mx.array(head * 10)
    weights[text_model + "norm.weight"] = mx.ones((width,))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config["text_config"]["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.anyio
async def test_the_speaking_model_says_its_text_whatever_it_is_asked(
    tmp_path: Path, lifespan: Lifespan
) -> None:
    model = speaking_model(tmp_path / "model", WORD)
    app = create_app(model, served_model_name=MODEL)
    async with in_process(app, lifespan, Served) as served:
        for temperature, prompt in ((0.0, "say hi"), (1.0, "Describe the weather.")):
            body = {"model": MODEL, "temperature": temperature, "max_tokens": 50}
            body["messages"] = [{"role": "user", "content": prompt}]
            (choice,) = (await served.chat(body)).json()["choices"]
            assert choice["message"]["content"] == WORD
            assert choice["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``serve`` of the speaking model with no setting but its name."""
    folder = tmp_path_factory.mktemp("agents")
    model = speaking_model(folder / "model", WORD)
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", str(model)]
    command += ["--served-model-name", MODEL, "--port", "0"]
    with running(command, folder / "server.log") as served:
        yield served


def run_agent(
    server: Server, command: list[str], env: dict[str, str], folder: Path
) -> None:
    """``command`` in ``folder``, with ``HOME`` there too: it exits 0, says
    the model's answer, and every request it made was answered 200."""
    before = len(server.log_text())
    done = subprocess.run(
        command,
        env={"PATH": os.environ["PATH"], "HOME": str(folder), **env},
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    requests = SERVED.findall(server.log_text()[before:])
    assert done.returncode == 0, done.stdout + done.stderr
    assert WORD in done.stdout, done.stdout + done.stderr
    assert ("POST", "/v1/chat/completions", "200") in requests, requests
    assert all(status == "200" for _, _, status in requests), requests


@pytest.mark.slow
def test_qwen_code(server: Server, tmp_path: Path) -> None:
    # --bare, one tool and a short system prompt: ~1,900 tokens, not ~48,000.
    command = [str(installed(QWEN_CODE)), "-p", "say hi", "--bare"]
    command += ["--system-prompt", "You are a coding agent."]
    command += ["--exclude-tools", "run_shell_command", "--exclude-tools", "edit"]
    env = {"OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": "x"}
    run_agent(server, command, env | {"OPENAI_MODEL": MODEL}, tmp_path)


@pytest.mark.slow
def test_opencode(server: Server, tmp_path: Path) -> None:
    # Read from the folder it runs in; one tool and a short agent prompt:
    # ~1,700 tokens, not ~22,000.
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "options": {"baseURL": f"{server.url}/v1", "apiKey": "x"},
        "models": {MODEL: {"name": MODEL}},
    }
    unused = ("bash", "edit", "glob", "grep", "skill", "task", "todowrite")
    config = {
        "provider": {"local": provider},
        "tools": dict.fromkeys((*unused, "webfetch", "write"), False),
        "agent": {"build": {"prompt": "You are a coding agent."}},
    }
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    command = [str(installed(OPENCODE)), "run", "-m", f"local/{MODEL}", "say hi"]
    env = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    run_agent(server, command, env, tmp_path)


@pytest.mark.slow
def test_pi(server: Server, tmp_path: Path) -> None:
    # Its whole default prompt and tools: ~4,500 tokens.
    provider = {
        "baseUrl": f"{server.url}/v1",
        "api": "openai-completions",
        "apiKey": "x",
        "models": [{"id": MODEL}],
    }
    agent = tmp_path / ".pi" / "agent"
    agent.mkdir(parents=True)
    (agent / "models.json").write_text(json.dumps({"providers": {"local": provider}}))
    command = [str(installed(PI)), "-p", "say hi", "--provider", "local"]
    command += ["--model", MODEL, "--offline"]
    run_agent(server, command, {}, tmp_path)
