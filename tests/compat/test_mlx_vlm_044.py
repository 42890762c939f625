"""The original bug, reproduced and fixed with mlx-vlm 0.4.4 (the bug report's version).

mlx-vlm 0.4.4 creates ``mlx_vlm.generate.generation_stream`` with
``mx.new_stream`` when it is imported: a plain ``mx.Stream`` owned by the
importing thread (0.5+ uses a thread-local stream). With mlx 0.32 streams are
thread-local on the CPU backend too, so on Linux:

(a) load on the main thread, ``await asyncio.to_thread(generate, ...)`` raises
    MLX's ``There is no Stream(cpu, N) in current thread.``;
(b) the same load and generation through an ``MLXThread`` works.

Runs only in the compat environment made by ``.ci/compat-mlx-vlm-044.sh``
(mlx-vlm 0.4.4 beside mlx[cpu] 0.32.4); anywhere else the module is skipped.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


MLX_VLM_VERSION = _installed("mlx-vlm")
if MLX_VLM_VERSION != "0.4.4":
    pytest.skip(
        "needs mlx-vlm 0.4.4, the bug report's version (plain generation_stream"
        f" made at import); this environment has mlx-vlm {MLX_VLM_VERSION}."
        " Run .ci/compat-mlx-vlm-044.sh",
        allow_module_level=True,
    )

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import asyncio  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

# Imported here, on the main thread, as the bug report's server did: this is
# where mlx-vlm 0.4.4 creates its generation_stream.
import mlx.core as mx  # noqa: E402
import mlx_vlm  # noqa: E402
from PIL import Image  # noqa: E402

from mlx_pinned import MLXThread  # noqa: E402
from mlx_pinned.testing import make_test_image, make_tiny_vlm  # noqa: E402

# `from mlx_vlm import generate` is the function, and it shadows the
# mlx_vlm.generate submodule as an attribute: reach the module this way.
GEN: Any = sys.modules["mlx_vlm.generate"]
PROMPTS: Any = importlib.import_module("mlx_vlm.prompt_utils")
LOAD: Any = mlx_vlm.load  # type: ignore[attr-defined]
IMPORT_STREAM = GEN.generation_stream

MAX_TOKENS = 16
MODEL_ENV = "MLX_PINNED_COMPAT_MODEL"


def _backport_torch_free_processor() -> None:
    """Let mlx-vlm 0.4.4 build its Qwen3-VL processor without torchvision.

    transformers 5.x checks every processor attribute against a base class;
    without torchvision the video-processor base class is a dummy, so 0.4.4's
    ``Qwen3VLProcessor(video_processor=None)`` always fails and ``load()``
    falls back to transformers' own processor, which needs PyTorch. Later
    mlx-vlm releases (0.7.x) override the check exactly like this; nothing
    else about 0.4.4 changes. Not needed when torchvision is installed.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return
    module: Any = importlib.import_module("mlx_vlm.models.qwen3_vl.processing_qwen3_vl")
    module.Qwen3VLProcessor.check_argument_for_proper_class = (
        lambda self, argument_name, argument: type(argument)
    )


_backport_torch_free_processor()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-VL folder: the one the CI script made, else a new one."""
    given = os.environ.get(MODEL_ENV)
    if given:
        path = pathlib.Path(given)
        assert (path / "config.json").is_file(), f"{MODEL_ENV}={given} is no model"
        return str(path)
    return str(make_tiny_vlm(tmp_path_factory.mktemp("compat044") / "tiny-vlm"))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE table: the character that stands for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = [*printable, *(256 + n for n in range(len(others)))]
    return {chr(c): b for c, b in zip(chars, [*printable, *others], strict=True)}


def _is_whole_utf8(token: str, alphabet: dict[str, int]) -> bool:
    try:
        bytes(alphabet[char] for char in token).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return False
    return True


@pytest.fixture(scope="module")
def no_broken_utf8(model_path: str) -> dict[int, float]:
    """A ``logit_bias`` that bans tokens which are not whole UTF-8 text.

    mlx-vlm 0.4.4's BPE streaming detokenizer decodes with ``errors="strict"``
    (0.7.x uses ``"replace"``), and a random-weight model happily emits lone
    bytes 0x80-0xFF: the request would die with a ``UnicodeDecodeError`` that
    has nothing to do with threads. Every generation here uses this bias.
    """
    alphabet = _byte_level_alphabet()
    tokenizer = json.loads((pathlib.Path(model_path) / "tokenizer.json").read_text())
    banned = {
        token_id: -1e9
        for token, token_id in tokenizer["model"]["vocab"].items()
        if not _is_whole_utf8(token, alphabet)
    }
    assert banned, "expected the byte tokens 0x80-0xFF in the vocabulary"
    return banned


def _image() -> Image.Image:
    return Image.open(io.BytesIO(make_test_image(64, 64, "PNG"))).convert("RGB")


def _prompt(model: Any, processor: Any) -> str:
    prompt: str = PROMPTS.apply_chat_template(
        processor, model.config, "Describe this image.", num_images=1
    )
    return prompt


def _generate(model: Any, processor: Any, prompt: str, bias: dict[int, float]) -> Any:
    return GEN.generate(
        model,
        processor,
        prompt,
        image=[_image()],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logit_bias=bias,
        verbose=False,
    )


def _no_stream_message(stream: Any) -> str:
    """MLX's message for ``stream`` used on a thread that does not own it."""
    found = re.fullmatch(r"Stream\(Device\((\w+), \d+\), (\d+)\)", repr(stream))
    assert found, repr(stream)
    kind, index = found.groups()
    return f"There is no Stream({kind}, {index}) in current thread."


def _assert_full_generation(result: Any, reference: Any) -> None:
    # Special tokens have zero embeddings in the tiny model: greedy decoding
    # never stops early, so every run makes exactly MAX_TOKENS tokens.
    assert result.generation_tokens == MAX_TOKENS
    assert result.text
    assert result.prompt_tokens == reference.prompt_tokens
    assert result.text == reference.text  # greedy: same weights, same tokens


@pytest.fixture(scope="module")
def reference(model_path: str, no_broken_utf8: dict[int, float]) -> Any:
    """The same request run entirely on the main thread (the thread that
    imported mlx-vlm): the control that shows model and request are fine."""
    model, processor = LOAD(model_path)
    result = _generate(model, processor, _prompt(model, processor), no_broken_utf8)
    assert result.generation_tokens == MAX_TOKENS
    assert result.text
    return result


def test_generation_stream_is_a_plain_stream_made_at_import() -> None:
    assert type(GEN.generation_stream) is mx.Stream
    assert not isinstance(GEN.generation_stream, mx.ThreadLocalStream)
    assert GEN.generation_stream is IMPORT_STREAM


def test_to_thread_reproduces_the_stream_error(
    model_path: str, reference: Any, no_broken_utf8: dict[int, float]
) -> None:
    """(a) The bug report: load on the main thread, generate through
    ``asyncio.to_thread``."""
    model, processor = LOAD(model_path)
    prompt = _prompt(model, processor)
    ran_on: list[int] = []

    def job() -> Any:
        ran_on.append(threading.get_ident())
        return _generate(model, processor, prompt, no_broken_utf8)

    async def serve() -> Any:
        return await asyncio.to_thread(job)

    with pytest.raises(RuntimeError) as caught:
        asyncio.run(serve())

    assert ran_on
    assert ran_on[0] != threading.get_ident()
    assert str(caught.value) == _no_stream_message(IMPORT_STREAM)
    assert str(caught.value) == "There is no Stream(cpu, 0) in current thread."


def test_a_plain_dedicated_thread_alone_does_not_fix_0_4_4(
    model_path: str, no_broken_utf8: dict[int, float]
) -> None:
    """Why MLXThread repoints ``generation_stream``: a thread that loads and
    generates still fails, because 0.4.4's stream belongs to the importer."""
    outcome: list[BaseException | Any] = []

    def worker() -> None:
        try:
            model, processor = LOAD(model_path)
            prompt = _prompt(model, processor)
            outcome.append(_generate(model, processor, prompt, no_broken_utf8))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            mx.clear_streams()  # a thread that used MLX must, before it ends

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()

    (error,) = outcome
    assert isinstance(error, RuntimeError)
    assert str(error) == _no_stream_message(IMPORT_STREAM)


def test_mlx_thread_fixes_it(
    model_path: str, reference: Any, no_broken_utf8: dict[int, float]
) -> None:
    """(b) The same load and request through mlx_pinned's pinned thread."""
    ran_on: list[int] = []

    def job(model: Any, processor: Any, prompt: str) -> Any:
        ran_on.append(threading.get_ident())
        return _generate(model, processor, prompt, no_broken_utf8)

    async def serve() -> tuple[Any, Any, int | None]:
        async with MLXThread(name="compat-044") as thread:
            model, processor = await thread.run(LOAD, model_path)
            prompt = _prompt(model, processor)
            first = await thread.run(job, model, processor, prompt)
            second = await thread.run(job, model, processor, prompt)
            return first, second, thread.ident

    first, second, ident = asyncio.run(serve())

    _assert_full_generation(first, reference)
    _assert_full_generation(second, reference)
    assert ran_on == [ident, ident]
    assert ident != threading.get_ident()
    # Closing the thread gives the module its own stream back.
    assert GEN.generation_stream is IMPORT_STREAM


def test_mlx_thread_streams_tokens(
    model_path: str, reference: Any, no_broken_utf8: dict[int, float]
) -> None:
    """(b) Streaming, as a server does: ``stream_generate`` through
    ``MLXThread.iterate``, one item per token."""

    async def serve() -> list[Any]:
        async with MLXThread(name="compat-044-stream") as thread:
            model, processor = await thread.run(LOAD, model_path)
            prompt = _prompt(model, processor)
            items = thread.iterate(
                GEN.stream_generate,
                model,
                processor,
                prompt,
                image=[_image()],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                logit_bias=no_broken_utf8,
            )
            return [item async for item in items]

    chunks = asyncio.run(serve())

    # One item per token, then 0.4.4's final item with the detokenizer's flush.
    counts = [chunk.generation_tokens for chunk in chunks]
    assert counts == [*range(1, MAX_TOKENS + 1), MAX_TOKENS]
    assert "".join(chunk.text for chunk in chunks) == reference.text
    assert GEN.generation_stream is IMPORT_STREAM
