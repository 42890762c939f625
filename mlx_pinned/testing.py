"""A tiny random-weight Qwen3-VL model and small images, for tests and benchmarks.

Everything here works offline: the model folder is written from mlx-vlm's own
Qwen3-VL model class, a byte-level BPE tokenizer trained on a few embedded
sentences and hand-written processor configs, so ``mlx_vlm.load(str(path))``
never reaches the Hugging Face hub.

Example::

    import mlx_vlm
    from mlx_pinned.testing import tiny_vlm_path

    model, processor = mlx_vlm.load(str(tiny_vlm_path()))

``import mlx_pinned.testing`` is cheap: MLX, mlx-vlm, ``tokenizers`` and
Pillow are imported inside the functions that need them.
"""

from __future__ import annotations

import base64
import errno
import functools
import io
import json
import os
import pathlib
import random
import shutil
import tempfile
import threading
import uuid
from importlib import metadata
from typing import Any, Final, cast

__all__ = [
    "SPECIAL_TOKENS",
    "image_data_uri",
    "make_test_image",
    "make_tiny_vlm",
    "tiny_vlm_path",
]

#: The tokenizer's special tokens, in id order (``<|endoftext|>`` is id 0).
SPECIAL_TOKENS: Final = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The tokenizer trainer gives the special tokens the first ids, in order.
_IDS: Final = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
# Bump when the files written change, so cached folders are rebuilt.
_FORMAT: Final = 4
_MARKER: Final = "mlx_pinned_tiny_vlm.json"
_VOCAB_SIZE: Final = 384
_INSTALL_ATTEMPTS: Final = 8
# errno values rename(2) reports when the destination is taken.
_TAKEN: Final = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})

_CORPUS: Final = (
    "Describe this image in one sentence.",
    "What is in this picture? Answer in a few words.",
    "You are a helpful assistant that describes images.",
    "The quick brown fox jumps over the lazy dog.",
    "A small red square sits on a blue background.",
    "There is a cat on the table next to a cup of tea.",
    "Please write a short story about a robot and a garden.",
    "The weather today is sunny with a light breeze from the sea.",
    "Count the objects in the image and list their colours.",
    "Hello! How can I help you today?",
    "Thank you, that was very helpful.",
    "The model runs on one thread that owns its stream.",
    "Green trees, white clouds, yellow sun and a grey road.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Is this a photo of a dog, a cat or a bird?",
    "Summarise the text below in one paragraph, please.",
)

# Qwen2/3-VL style: no default system prompt; content is a string or a list of
# typed parts, images and videos wrapped in vision markers. Tools, tool calls
# and tool results as Qwen3's template writes them (Hermes' <tool_call>).
# enable_thinking (mlx-vlm passes false unless asked) opens <think> in the
# generation prompt, as Qwen3-VL-Thinking's template does: plain prompts stay
# as they were, and a request can switch thinking on.
_CHAT_TEMPLATE: Final = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}"
    "{{- part -}}"
    "{%- else -%}"
    "{%- set kind = part.get('type', '') -%}"
    "{%- if kind in ('image', 'image_url', 'input_image') or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif kind in ('video', 'video_url', 'input_video') or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- render(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the "
    "user query.\\n\\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' + (tool | tojson) -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:"
    '\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render(message['content']) "
    "+ '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- render(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first or message['content'] -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- set function = call['function'] if call.get('function') else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' -}}"
    "{%- if function['arguments'] is string -%}"
    "{{- function['arguments'] -}}"
    "{%- else -%}"
    "{{- function['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is true -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

_MIME: Final = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_MIME_ALIASES: Final = {"JPG": "JPEG"}


def make_tiny_vlm(
    path: str | os.PathLike[str], *, seed: int = 0, overwrite: bool = False
) -> pathlib.Path:
    """Write a tiny random-weight Qwen3-VL model folder that mlx-vlm loads offline.

    The model has a 2-layer, 64-wide text model with tied embeddings and a
    2-layer, 32-wide vision tower (patch 16, spatial merge 2, one deepstack
    layer): about 215k float32 parameters, under 1 MB on disk. A 64x64 image
    becomes 4 image tokens. The special tokens have zero embeddings, so greedy
    decoding never picks one and always runs to ``max_tokens``; to test a stop,
    bias ``<|im_end|>`` with ``logit_bias``.

    The files are written to a temporary folder beside ``path`` and renamed
    into place, so a folder that appears at ``path`` is always complete. Calls
    for the same or different paths may run at once from any threads or
    processes. A folder being replaced (``overwrite``, another seed, an older
    format) is renamed aside and deleted only after the new one is in place;
    a reader that opened the old folder before that may see it emptied.

    Runs on the calling thread, which need not be an MLX thread: it builds no
    lazy MLX array and gets no MLX stream. The first call in a process also
    imports mlx-vlm and builds its model class once, on a short-lived private
    thread, to learn the parameter names and shapes; after that a call takes
    tens of milliseconds. It blocks and cannot be cancelled part-way; if it
    raises, its temporary folder is removed.

    Args:
        path: The folder to write. Its parent is created if missing.
        seed: Seeds the weights. The same seed gives byte-identical files.
        overwrite: Replace whatever is at ``path``, even a complete model with
            the same seed.

    Returns:
        ``path`` as a :class:`pathlib.Path`, holding the model.

    Raises:
        FileExistsError: ``path`` holds something that is not a model written
            by this function, and ``overwrite`` is false.
    """
    target = pathlib.Path(path)
    if not overwrite:
        if _is_complete(target, seed):
            return target
        _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    )
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a cache is shared
        _write_model(staging, seed)
        _install(staging, target, seed, overwrite=overwrite)
    finally:
        # Still there only when the install failed.
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_vlm_path() -> pathlib.Path:
    """Return the shared default tiny model (seed 0), writing it on first use.

    The folder is ``$MLX_PINNED_CACHE/tiny-vlm``, or
    ``~/.cache/mlx-pinned/tiny-vlm`` when ``MLX_PINNED_CACHE`` is unset. It is
    rebuilt when the files this module writes or the installed mlx-vlm version
    change. Runs on the calling thread, like :func:`make_tiny_vlm`; when the
    model is already there it only reads a small JSON file. Safe to call from
    any thread or process at once.

    Returns:
        The model folder.
    """
    root = os.environ.get("MLX_PINNED_CACHE")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "mlx-pinned"
    return make_tiny_vlm(base / "tiny-vlm", seed=0)


def make_test_image(
    width: int = 64, height: int = 64, fmt: str = "JPEG", seed: int = 0
) -> bytes:
    """Encode a small deterministic picture: a background and a few shapes.

    Args:
        width: Width in pixels.
        height: Height in pixels.
        fmt: A Pillow format name such as ``"JPEG"``, ``"PNG"`` or ``"WEBP"``.
        seed: Picks the colours and shapes; the same arguments give the same
            bytes with the same Pillow.

    Runs on the calling thread; no MLX is involved.

    Returns:
        The encoded image.

    Raises:
        ValueError: ``width`` or ``height`` is not positive.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"Pass a positive width and height, not {width}x{height}.")
    from PIL import Image, ImageDraw

    rng = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    image = Image.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(image)
    for index in range(4):
        x0, x1 = sorted(rng.randrange(width) for _ in range(2))
        y0, y1 = sorted(rng.randrange(height) for _ in range(2))
        shape = draw.ellipse if index % 2 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour())
    buffer = io.BytesIO()
    image.save(buffer, format=_format_name(fmt))
    return buffer.getvalue()


def image_data_uri(
    width: int = 64, height: int = 64, fmt: str = "JPEG", seed: int = 0
) -> str:
    """Return :func:`make_test_image` as a base64 ``data:`` URI.

    Args:
        width: Width in pixels.
        height: Height in pixels.
        fmt: ``"JPEG"``, ``"PNG"`` or ``"WEBP"``.
        seed: Picks the colours and shapes.

    Returns:
        A URI such as ``data:image/jpeg;base64,...``, the form OpenAI-style
        ``image_url`` content parts carry.

    Raises:
        ValueError: The format has no known MIME type, or the size is not
            positive.
    """
    name = _format_name(fmt)
    if name not in _MIME:
        raise ValueError(f"Use one of {sorted(_MIME)} for a data URI, not {fmt!r}.")
    encoded = base64.b64encode(make_test_image(width, height, name, seed))
    return f"data:{_MIME[name]};base64,{encoded.decode('ascii')}"


def _format_name(fmt: str) -> str:
    name = fmt.upper()
    return _MIME_ALIASES.get(name, name)


# -- writing the folder --------------------------------------------------------


def _write_model(folder: pathlib.Path, seed: int) -> None:
    """Write every file of the model into ``folder`` (the marker last)."""
    files: dict[str, bytes] = {
        "config.json": _json(_model_config()),
        "generation_config.json": _json(
            {
                "bos_token_id": _IDS["<|endoftext|>"],
                "eos_token_id": [_IDS["<|im_end|>"], _IDS["<|endoftext|>"]],
                "pad_token_id": _IDS["<|endoftext|>"],
            }
        ),
        "tokenizer.json": _tokenizer_json(),
        "tokenizer_config.json": _json(_tokenizer_config()),
        "preprocessor_config.json": _json(_image_processor_config()),
        "video_preprocessor_config.json": _json(_video_processor_config()),
        "processor_config.json": _json({"processor_class": "Qwen3VLProcessor"}),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    _write_weights(folder / "model.safetensors", seed)
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    (folder / _MARKER).write_bytes(_json(_marker(seed, sizes)))


def _marker(seed: int, sizes: dict[str, int]) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "generator": "mlx_pinned.testing.make_tiny_vlm",
        "mlx_vlm": _mlx_vlm_version(),
        "seed": seed,
        "files": sizes,
    }


def _mlx_vlm_version() -> str:
    try:
        return metadata.version("mlx-vlm")
    except metadata.PackageNotFoundError:
        return "unknown"


def _json(value: object) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _model_config() -> dict[str, Any]:
    text = {
        "model_type": "qwen3_vl_text",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": _VOCAB_SIZE,
        "max_position_embeddings": 32768,
        "rope_theta": 5000000.0,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": _IDS["<|endoftext|>"],
        "eos_token_id": _IDS["<|im_end|>"],
        "dtype": "float32",
    }
    vision = {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
        "hidden_act": "gelu_pytorch_tanh",
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": _IDS["<|image_pad|>"],
        "video_token_id": _IDS["<|video_pad|>"],
        "vision_start_token_id": _IDS["<|vision_start|>"],
        "vision_end_token_id": _IDS["<|vision_end|>"],
        "vision_token_id": _IDS["<|vision_pad|>"],
        "tie_word_embeddings": True,
        "vocab_size": _VOCAB_SIZE,
        "dtype": "float32",
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(_IDS[token]): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token in SPECIAL_TOKENS
        },
        "chat_template": _CHAT_TEMPLATE,
    }


def _pixel_settings(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    return {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "do_convert_rgb": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def _image_processor_config() -> dict[str, Any]:
    # 32*32 .. 128*128 pixels: a 64x64 image stays 64x64, 4x4 patches, and the
    # 2x2 merge makes 4 image tokens.
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        **_pixel_settings(32 * 32, 128 * 128),
    }


def _video_processor_config() -> dict[str, Any]:
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "fps": 2,
        "min_frames": 2,
        "max_frames": 8,
        **_pixel_settings(32 * 32, 128 * 128),
    }


@functools.cache
def _tokenizer_json() -> bytes:
    """Train the byte-level BPE tokenizer, once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    if tokenizer.get_vocab_size() != _VOCAB_SIZE or any(
        tokenizer.token_to_id(token) != index for token, index in _IDS.items()
    ):
        # The corpus is fixed, so this only happens if `tokenizers` changes.
        raise RuntimeError(
            f"The tiny tokenizer came out with {tokenizer.get_vocab_size()} tokens "
            "or moved its special tokens; adjust _CORPUS in mlx_pinned/testing.py."
        )
    return tokenizer.to_str().encode("utf-8")


def _high_byte_ids() -> list[int]:
    """Token ids of the single bytes 0x80-0xFF in the byte-level vocabulary."""
    # GPT-2's byte-to-character table, which the ByteLevel pre-tokenizer uses.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    shifted = [byte for byte in range(256) if byte not in printable]
    as_char = {byte: chr(byte) for byte in printable}
    as_char.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    vocab: dict[str, int] = json.loads(_tokenizer_json())["model"]["vocab"]
    return sorted(vocab[as_char[byte]] for byte in range(0x80, 0x100))


_SPECS_LOCK = threading.Lock()
_specs: tuple[tuple[str, tuple[int, ...]], ...] | None = None


def _parameter_specs() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Return the (name, shape) of every parameter of mlx-vlm's Qwen3-VL class.

    The model is built once per process, on a private thread: building it
    makes lazy MLX arrays, which bind a stream to the building thread, and a
    process whose worker threads still hold MLX streams can abort at exit.
    The private thread clears its streams before it ends.
    """
    global _specs
    import importlib

    # Import mlx-vlm here, on the caller's thread: mlx-vlm < 0.5 makes its
    # plain generation_stream at import, for the importing thread.
    importlib.import_module("mlx_vlm.models.qwen3_vl")
    with _SPECS_LOCK:
        if _specs is None:
            found: list[tuple[tuple[str, tuple[int, ...]], ...]] = []
            errors: list[BaseException] = []

            def build() -> None:
                import mlx.core as mx

                try:
                    found.append(_build_specs())
                except BaseException as exc:  # re-raised on the caller
                    errors.append(exc)
                finally:
                    mx.clear_streams()

            worker = threading.Thread(target=build, name="mlx-pinned-tiny-vlm")
            worker.start()
            worker.join()
            if errors:
                raise errors[0]
            _specs = found[0]
        return _specs


def _build_specs() -> tuple[tuple[str, tuple[int, ...]], ...]:
    import importlib

    from mlx.utils import tree_flatten

    # Typed as Any on purpose: mlx-vlm ships py.typed, but the Qwen3-VL
    # classes are untyped.
    qwen3_vl: Any = importlib.import_module("mlx_vlm.models.qwen3_vl")
    config = _model_config()
    # mlx-vlm 0.4.x keeps nested configs as dicts; 0.7.x converts them itself.
    config["text_config"] = qwen3_vl.TextConfig.from_dict(config["text_config"])
    config["vision_config"] = qwen3_vl.VisionConfig.from_dict(config["vision_config"])
    model = qwen3_vl.Model(qwen3_vl.ModelConfig.from_dict(config))
    flat = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    return tuple(sorted((name, tuple(value.shape)) for name, value in flat))


def _write_weights(file: pathlib.Path, seed: int) -> None:
    """Draw the weights from ``seed`` with NumPy and save them with MLX.

    NumPy, not ``mx.random``: drawing MLX random numbers binds a stream to the
    calling thread (see :func:`_parameter_specs`), and a NumPy generator is
    seeded per call, so concurrent calls cannot disturb each other.
    """
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _parameter_specs():
        if len(shape) > 1:
            fan_in = int(np.prod(shape[1:]))
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)
        elif name.endswith("bias"):
            value = np.zeros(shape, dtype=np.float32)
        else:  # norm scales
            value = np.ones(shape, dtype=np.float32)
        if name == "language_model.model.embed_tokens.weight":
            # Tied embeddings: a zero row gives a zero logit, below the best of
            # the other ~376 random logits, so greedy decoding never picks a
            # special token (no early <|im_end|>).
            value[list(_IDS.values())] = 0.0
            # Likewise the lone bytes 0x80-0xFF: alone they are invalid UTF-8,
            # which some detokenizers (mlx-vlm 0.4.4's) refuse with an error.
            value[_high_byte_ids()] = 0.0
        # A mx.array made from host memory is already evaluated: no stream.
        weights[name] = mx.array(value)
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})


# -- installing the folder -----------------------------------------------------


def _is_complete(folder: pathlib.Path, seed: int) -> bool:
    """Whether ``folder`` holds a complete model of this format with ``seed``."""
    try:
        marker = json.loads((folder / _MARKER).read_bytes())
        expected = _marker(seed, marker["files"])
        return marker == expected and all(
            (folder / name).stat().st_size == size
            for name, size in marker["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _check_replaceable(target: pathlib.Path) -> None:
    """Raise unless ``target`` is absent, an empty folder or one of our models."""
    if not os.path.lexists(target):
        return
    if target.is_dir() and not target.is_symlink():
        if (target / _MARKER).is_file() or not any(target.iterdir()):
            return
    raise FileExistsError(
        f"{target} exists and is not a model written by make_tiny_vlm; "
        "pass overwrite=True to replace it, or choose another path."
    )


def _install(
    staging: pathlib.Path, target: pathlib.Path, seed: int, *, overwrite: bool
) -> None:
    """Rename ``staging`` to ``target``, moving aside what is in the way."""
    replace_complete = overwrite
    trash: list[pathlib.Path] = []
    try:
        for _ in range(_INSTALL_ATTEMPTS):
            try:
                # Atomic; replaces an empty folder, fails on anything else.
                staging.rename(target)
                return
            except OSError as exc:
                if exc.errno not in _TAKEN:
                    raise
            # Another call may have installed the same model meanwhile: keep
            # it, unless this call must replace what was there when it began.
            if not replace_complete and _is_complete(target, seed):
                return
            replace_complete = False
            if not overwrite:
                _check_replaceable(target)
            trash.extend(_move_aside(target))
        raise RuntimeError(
            f"Could not install the tiny model at {target}: other writers kept "
            "replacing it; call make_tiny_vlm again once they are done."
        )
    finally:
        # Deleted only now, so the path is missing for two renames at most.
        for old in trash:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def _move_aside(target: pathlib.Path) -> list[pathlib.Path]:
    """Rename ``target`` to a hidden sibling and return it (none if it is gone)."""
    trash = target.with_name(f".{target.name}.{uuid.uuid4().hex}.old")
    try:
        target.rename(trash)
    except FileNotFoundError:  # another writer moved it first
        return []
    return [trash]
