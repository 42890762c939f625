"""Tests for mlx_pinned.testing: the tiny offline models and the test images."""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from PIL import Image

import mlx_pinned.testing
from mlx_pinned.testing import (
    SPECIAL_TOKENS,
    TINY_EMBEDDING_TYPES,
    TINY_LM_TYPES,
    TINY_MODEL_TYPES,
    TINY_OMNI_TYPES,
    TINY_RERANKER_TYPES,
    TINY_SPEECH_TYPES,
    TINY_TOOL_LM_TYPES,
    TINY_TRANSCRIPTION_TYPES,
    image_data_uri,
    make_test_image,
    make_tiny_embedding,
    make_tiny_lm,
    make_tiny_omni,
    make_tiny_reranker,
    make_tiny_speech,
    make_tiny_transcription,
    make_tiny_vlm,
    tiny_embedding_path,
    tiny_lm_path,
    tiny_omni_path,
    tiny_reranker_path,
    tiny_speech_path,
    tiny_vlm_path,
)

# mlx-vlm ships py.typed, but not the types these calls need (PIL images).
mlx_vlm: Any = importlib.import_module("mlx_vlm")
REPO_ROOT = pathlib.Path(mlx_pinned.testing.__file__).resolve().parents[2]
PROMPT = "Describe this image in one sentence."
MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "mlx_pinned_tiny_vlm.json",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "video_preprocessor_config.json",
}


class HubCalls:
    """Records, and refuses, every attempt to reach the network or the hub."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def refuse(self, what: str) -> Any:
        def refused(*args: object, **kwargs: object) -> Any:
            self.calls.append(f"{what}{args}")
            raise OSError(f"{what} called in an offline test")

        return refused


@pytest.fixture
def hub_calls(monkeypatch: pytest.MonkeyPatch) -> HubCalls:
    """Make the hub and sockets unreachable and record who tried them.

    mlx-vlm swallows hub errors while it looks for processor files, so refusing
    is not enough: the test must check that nobody asked.
    """
    import huggingface_hub

    calls = HubCalls()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", calls.refuse("socket.connect"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", calls.refuse("download"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", calls.refuse("snapshot"))
    monkeypatch.setattr(
        sys.modules["mlx_vlm.utils"], "snapshot_download", calls.refuse("snapshot")
    )
    return calls


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def loaded(model_dir: pathlib.Path) -> tuple[Any, Any]:
    model, processor = mlx_vlm.load(str(model_dir))
    return model, processor


def picture(seed: int = 0, size: int = 64) -> Image.Image:
    return Image.open(io.BytesIO(make_test_image(size, size, seed=seed)))


def chat_prompt(loaded: tuple[Any, Any], text: str = PROMPT) -> str:
    model, processor = loaded
    prompt: str = mlx_vlm.apply_chat_template(
        processor, model.config, text, num_images=1
    )
    return prompt


def run(loaded: tuple[Any, Any], image: Image.Image, **kwargs: Any) -> Iterator[Any]:
    model, processor = loaded
    return iter(
        mlx_vlm.stream_generate(
            model, processor, chat_prompt(loaded), image=[image], **kwargs
        )
    )


def greedy(
    loaded: tuple[Any, Any], image: Image.Image, max_tokens: int
) -> tuple[list[int], list[float]]:
    """Token ids and their log-probabilities of one greedy generation."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for result in run(loaded, image, max_tokens=max_tokens, temperature=0.0):
        if result.finish_reason is None:  # the final result repeats a token
            tokens.append(result.token)
            logprobs.append(result.logprobs[result.token].item())
    return tokens, logprobs


def read_all(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


class TestMakeTinyVlm:
    def test_writes_the_model_files(self, model_dir: pathlib.Path) -> None:
        assert {p.name for p in model_dir.iterdir()} == MODEL_FILES
        total = sum(p.stat().st_size for p in model_dir.iterdir())
        assert total < 1_000_000

    def test_model_has_the_specified_shape(self, loaded: tuple[Any, Any]) -> None:
        from mlx.utils import tree_flatten

        model, processor = loaded
        text, vision = model.config.text_config, model.config.vision_config
        assert (text.num_hidden_layers, text.hidden_size, text.head_dim) == (2, 64, 16)
        assert (text.num_attention_heads, text.num_key_value_heads) == (4, 2)
        assert text.tie_word_embeddings
        assert text.rope_scaling["mrope_section"] == [4, 2, 2]
        assert (vision.depth, vision.hidden_size, vision.patch_size) == (2, 32, 16)
        assert vision.num_position_embeddings == 16
        assert len(vision.deepstack_visual_indexes) == 1
        flat: Any = tree_flatten(model.parameters())
        params = sum(value.size for _, value in flat)
        assert 200_000 < params < 230_000
        assert len(processor.tokenizer) == 384

    def test_loads_without_the_hub(
        self, model_dir: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        model, processor = mlx_vlm.load(str(model_dir))
        assert hub_calls.calls == []
        assert model.config.model_type == "qwen3_vl"
        assert processor.image_processor.max_pixels == 128 * 128

    def test_hub_guard_catches_a_missing_processor_file(
        self, model_dir: pathlib.Path, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        # Shows the guard above is not vacuous: without processor_config.json
        # mlx-vlm asks the hub, then silently carries on.
        copy = tmp_path / "copy"
        copy.mkdir()
        for name, data in read_all(model_dir).items():
            if name != "processor_config.json":
                (copy / name).write_bytes(data)
        mlx_vlm.load(str(copy))
        assert hub_calls.calls

    def test_generates_the_requested_tokens_with_an_image(
        self, loaded: tuple[Any, Any]
    ) -> None:
        model, processor = loaded
        result = mlx_vlm.generate(
            model, processor, chat_prompt(loaded), image=[picture()], max_tokens=32
        )
        assert result.generation_tokens == 32
        assert len(result.token_ids) == 32
        assert result.finish_reason == "length"
        # The chat template, 4 image tokens and the text of the request.
        assert result.prompt_tokens == 32

    def test_greedy_decoding_never_emits_a_special_token(
        self, loaded: tuple[Any, Any]
    ) -> None:
        tokens, _ = greedy(loaded, picture(), max_tokens=64)
        special = set(loaded[1].tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
        assert len(tokens) == 64
        assert special.isdisjoint(tokens)

    @pytest.mark.slow
    def test_greedy_text_is_valid_utf8(self, loaded: tuple[Any, Any]) -> None:
        # Lone bytes 0x80-0xFF have zero embeddings: never picked, so the
        # text never holds U+FFFD (and strict detokenizers never fail).
        for seed in range(6):
            tokens, _ = greedy(loaded, picture(seed=seed), max_tokens=48)
            text = loaded[1].tokenizer.decode(tokens)
            assert len(tokens) == 48
            assert "\ufffd" not in text

    def test_logit_bias_on_im_end_stops_generation(
        self, loaded: tuple[Any, Any]
    ) -> None:
        im_end = loaded[1].tokenizer.convert_tokens_to_ids("<|im_end|>")
        results = list(
            run(loaded, picture(), max_tokens=32, logit_bias={im_end: 100.0})
        )
        assert results[-1].finish_reason == "stop"
        assert results[-1].token == im_end

    def test_greedy_generation_is_repeatable(self, loaded: tuple[Any, Any]) -> None:
        first = greedy(loaded, picture(), max_tokens=16)
        second = greedy(loaded, picture(), max_tokens=16)
        assert first == second

    def test_the_image_reaches_the_model(self, loaded: tuple[Any, Any]) -> None:
        _, with_one = greedy(loaded, picture(seed=0), max_tokens=1)
        _, with_other = greedy(loaded, picture(seed=1), max_tokens=1)
        assert with_one != with_other

    @pytest.mark.parametrize(
        ("size", "patches", "image_tokens"),
        [(64, 4, 4), (128, 8, 16), (512, 8, 16)],  # 128x128 pixels at most
    )
    def test_images_become_few_image_tokens(
        self, loaded: tuple[Any, Any], size: int, patches: int, image_tokens: int
    ) -> None:
        _, processor = loaded
        inputs = processor(
            text=[chat_prompt(loaded)], images=[picture(size=size)], padding=True
        )
        ids = inputs["input_ids"].tolist()[0]
        assert ids.count(processor.image_token_id) == image_tokens
        assert inputs["image_grid_thw"].tolist() == [[1, patches, patches]]

    def test_chat_template_renders_system_turns_and_images(
        self, loaded: tuple[Any, Any]
    ) -> None:
        _, processor = loaded
        messages = [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare "},
                    {"type": "image"},
                    {"type": "text", "text": " and "},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Same."}]},
            {"role": "user", "content": "Why?"},
        ]
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        expected = (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            f"<|im_start|>user\nCompare {image} and {image}<|im_end|>\n"
            "<|im_start|>assistant\nSame.<|im_end|>\n"
            "<|im_start|>user\nWhy?<|im_end|>\n"
        )
        render = processor.tokenizer.apply_chat_template
        assert render(messages, tokenize=False) == expected
        assert (
            render(messages, tokenize=False, add_generation_prompt=True)
            == expected + "<|im_start|>assistant\n"
        )

    def test_mlx_vlm_prompt_for_one_image(self, loaded: tuple[Any, Any]) -> None:
        assert chat_prompt(loaded) == (
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            f"{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
        )

    def test_special_tokens_encode_as_one_token(self, loaded: tuple[Any, Any]) -> None:
        tokenizer = loaded[1].tokenizer
        ids = tokenizer.encode("".join(SPECIAL_TOKENS), add_special_tokens=True)
        assert ids == list(range(len(SPECIAL_TOKENS)))
        assert tokenizer.eos_token == "<|im_end|>"

    def test_same_seed_is_byte_identical(self, tmp_path: pathlib.Path) -> None:
        first = read_all(make_tiny_vlm(tmp_path / "a", seed=3))
        second = read_all(make_tiny_vlm(tmp_path / "b", seed=3))
        assert first == second

    def test_different_seeds_differ_only_in_weights(
        self, tmp_path: pathlib.Path
    ) -> None:
        first = read_all(make_tiny_vlm(tmp_path / "a", seed=0))
        second = read_all(make_tiny_vlm(tmp_path / "b", seed=1))
        differing = {name for name in first if first[name] != second[name]}
        assert differing == {"model.safetensors", "mlx_pinned_tiny_vlm.json"}

    def test_returns_a_complete_model_without_rewriting(
        self, tmp_path: pathlib.Path
    ) -> None:
        path = make_tiny_vlm(tmp_path / "model")
        before = path.stat().st_ino
        assert make_tiny_vlm(path) == path
        assert path.stat().st_ino == before
        make_tiny_vlm(path, overwrite=True)
        assert path.stat().st_ino != before

    def test_rebuilds_a_model_with_another_seed(self, tmp_path: pathlib.Path) -> None:
        path = make_tiny_vlm(tmp_path / "model", seed=1)
        make_tiny_vlm(path, seed=2)
        marker = json.loads((path / "mlx_pinned_tiny_vlm.json").read_text())
        assert marker["seed"] == 2

    def test_rebuilds_an_incomplete_model(self, tmp_path: pathlib.Path) -> None:
        path = make_tiny_vlm(tmp_path / "model")
        (path / "tokenizer.json").unlink()
        make_tiny_vlm(path)
        assert {p.name for p in path.iterdir()} == MODEL_FILES

    def test_fills_an_empty_folder(self, tmp_path: pathlib.Path) -> None:
        assert make_tiny_vlm(tmp_path) == tmp_path
        assert {p.name for p in tmp_path.iterdir()} == MODEL_FILES

    def test_refuses_a_foreign_folder(self, tmp_path: pathlib.Path) -> None:
        (tmp_path / "notes.txt").write_text("mine")
        with pytest.raises(FileExistsError, match="overwrite=True"):
            make_tiny_vlm(tmp_path)
        assert (tmp_path / "notes.txt").read_text() == "mine"

    def test_overwrite_replaces_a_foreign_file(self, tmp_path: pathlib.Path) -> None:
        path = tmp_path / "model"
        path.write_text("not a folder")
        with pytest.raises(FileExistsError):
            make_tiny_vlm(path)
        make_tiny_vlm(path, overwrite=True)
        assert {p.name for p in path.iterdir()} == MODEL_FILES

    def test_concurrent_calls_on_one_path(self, tmp_path: pathlib.Path) -> None:
        path = tmp_path / "model"
        start = threading.Barrier(8)

        def make(index: int) -> pathlib.Path:
            start.wait()
            return make_tiny_vlm(path, overwrite=index % 3 == 0)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(make, range(8)))
        assert results == [path] * 8
        assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no leftovers
        assert read_all(path) == read_all(make_tiny_vlm(tmp_path / "fresh"))

    def test_readers_never_see_a_partial_folder(self, tmp_path: pathlib.Path) -> None:
        seen: list[frozenset[str]] = []

        def listing(path: pathlib.Path) -> frozenset[str] | None:
            try:
                return frozenset(os.listdir(path))
            except FileNotFoundError:  # not there yet
                return None

        def read(path: pathlib.Path, done: threading.Event) -> None:
            while not done.is_set():
                if (names := listing(path)) is not None:
                    seen.append(names)

        for round_ in range(4):
            path = tmp_path / f"model-{round_}"
            done = threading.Event()
            reader = threading.Thread(target=read, args=(path, done))
            reader.start()
            try:
                with ThreadPoolExecutor(3) as pool:
                    list(pool.map(make_tiny_vlm, [path] * 3))
            finally:
                done.set()
                reader.join()
        assert seen
        assert set(seen) == {frozenset(MODEL_FILES)}


def generate_offline(path: pathlib.Path, images: int, max_tokens: int = 8) -> Any:
    """Load a tiny model and generate greedily, with ``images`` test images."""
    model, processor = mlx_vlm.load(str(path))
    prompt = mlx_vlm.apply_chat_template(
        processor, model.config, PROMPT, num_images=images
    )
    pictures = [picture(seed=i) for i in range(images)] or None
    return mlx_vlm.generate(
        model, processor, prompt, image=pictures, max_tokens=max_tokens
    )


# Image tokens a 64x64 image becomes in each vision family's prompt.
IMAGE_TOKENS = {
    "qwen3_vl": 4,
    "qwen2_5_vl": 4,
    "qwen3_5": 4,
    "gemma3": 4,
    "smolvlm": 20,  # 2x2 tiles and the whole image, 4 each
    "mistral3": 16,  # 4 rows of 4
    "aya_vision": 4,  # the global view alone: a square fits one tile
}


class TestFamilies:
    def test_lists_the_vision_and_text_families(self) -> None:
        assert TINY_MODEL_TYPES[0] == "qwen3_vl"
        assert set(TINY_MODEL_TYPES) == set(IMAGE_TOKENS)
        assert TINY_LM_TYPES[:2] == ("qwen3", "llama")

    @pytest.mark.slow
    @pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
    def test_each_vision_family_generates_offline_with_an_image(
        self, model_type: str, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        path = make_tiny_vlm(tmp_path / "model", model_type=model_type)
        result = generate_offline(path, images=1)
        assert hub_calls.calls == []
        assert json.loads((path / "config.json").read_text())["model_type"] == (
            model_type
        )
        assert result.generation_tokens == 8
        assert sum(p.stat().st_size for p in path.iterdir()) < 2_000_000

    @pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
    def test_each_vision_family_turns_an_image_into_its_image_tokens(
        self, model_type: str, tmp_path: pathlib.Path
    ) -> None:
        path = make_tiny_vlm(tmp_path / "model", model_type=model_type)
        model, processor = mlx_vlm.load(str(path))
        messages = [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": PROMPT},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                ],
            },
        ]
        tokenizer = getattr(processor, "tokenizer", processor)
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert "Be brief." in prompt
        assert PROMPT in prompt
        config = model.config
        image_token = getattr(config, "image_token_index", None)
        if image_token is None:
            image_token = config.image_token_id
        inputs = mlx_vlm.prepare_inputs(
            processor,
            images=[picture(size=64)],
            prompts=prompt,
            image_token_index=getattr(config, "image_token_index", None),
        )
        ids = inputs["input_ids"].tolist()[0]
        assert ids.count(image_token) == IMAGE_TOKENS[model_type]

    @pytest.mark.slow
    @pytest.mark.parametrize("model_type", TINY_LM_TYPES)
    def test_each_text_family_generates_offline(
        self, model_type: str, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        path = make_tiny_lm(tmp_path / "model", model_type)
        result = generate_offline(path, images=0, max_tokens=16)
        assert hub_calls.calls == []
        assert result.generation_tokens == 16
        assert "\ufffd" not in result.text
        assert not (path / "preprocessor_config.json").exists()

    def test_a_text_model_has_no_image_processor(self, tmp_path: pathlib.Path) -> None:
        model, processor = mlx_vlm.load(str(make_tiny_lm(tmp_path / "lm")))
        assert not hasattr(model, "vision_tower")
        assert getattr(processor, "image_processor", None) is None
        assert processor.eos_token == "<|im_end|>"

    def test_another_family_replaces_a_folder(self, tmp_path: pathlib.Path) -> None:
        path = make_tiny_vlm(tmp_path / "model")
        make_tiny_lm(path, "llama")
        assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
        marker = json.loads((path / "mlx_pinned_tiny_vlm.json").read_text())
        assert marker["model_type"] == "llama"

    def test_unknown_families_are_refused(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ValueError, match="qwen3_vl"):
            make_tiny_vlm(tmp_path, model_type="qwen3")
        with pytest.raises(ValueError, match="llama"):
            make_tiny_lm(tmp_path, "qwen3_vl")
        assert not any(tmp_path.iterdir())

    def test_the_cached_folders_are_named_by_family(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("MLX_PINNED_CACHE", str(tmp_path))
        assert tiny_lm_path() == tmp_path / "tiny-lm-qwen3"
        assert tiny_lm_path("llama") == tmp_path / "tiny-lm-llama"
        other = TINY_MODEL_TYPES[1]
        assert tiny_vlm_path(other) == tmp_path / f"tiny-vlm-{other}"


class TestOmniFamilies:
    """The tiny Gemma 4, as mlx-vlm loads it: audio through its own processor."""

    def test_gemma4_takes_audio_offline(
        self, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        import numpy as np

        assert TINY_OMNI_TYPES == ("gemma4",)
        path = make_tiny_omni(tmp_path / "gemma4")
        model, processor = mlx_vlm.load(str(path))
        assert hub_calls.calls == []
        assert model.config.audio_config is not None
        assert processor.feature_extractor.sampling_rate == 16000
        second = np.sin(np.arange(16000, dtype=np.float32) * 0.05) * 0.3
        messages = [{"role": "user", "content": [{"type": "audio"}]}]
        prompt = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        utils = importlib.import_module("mlx_vlm.utils")
        inputs = utils.prepare_inputs(processor, audio=[second], prompts=prompt)
        ids = inputs["input_ids"][0].tolist()
        # 40 ms a token: a second is 25, between the audio markers.
        assert ids.count(model.config.audio_token_id) == 25
        assert ids.count(model.config.boa_token_id) == 1
        assert inputs["input_features"].shape[-1] == 128
        embedded = model.get_input_embeddings(
            inputs["input_ids"],
            None,
            input_features=inputs["input_features"],
            input_features_mask=inputs["input_features_mask"],
        ).inputs_embeds
        plain = model.language_model.model.embed_tokens(inputs["input_ids"])
        spots = np.array(ids) == model.config.audio_token_id
        audio_rows = np.array(embedded[0])[spots]
        # The audio tower's features, not the placeholder's embedding.
        assert not np.allclose(audio_rows, np.array(plain[0])[spots])
        assert len({row.tobytes() for row in audio_rows}) > 20

    def test_the_cached_folder_is_named_by_family(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("MLX_PINNED_CACHE", str(tmp_path))
        assert tiny_omni_path() == tmp_path / "tiny-omni-gemma4"
        with pytest.raises(ValueError, match="gemma4"):
            make_tiny_omni(tmp_path / "x", "qwen3_vl")


class TestTranscriptionFamilies:
    """The tiny Whisper, as mlx-audio's own loader loads it."""

    def test_whisper_is_multilingual_and_decodes_text_offline(
        self, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        import mlx.core as mx
        import numpy as np
        from mlx_audio.stt.utils import load_model

        assert TINY_TRANSCRIPTION_TYPES == ("whisper", "parakeet")
        path = make_tiny_transcription(tmp_path / "whisper")
        model = load_model(str(path))
        tokenizer = model.get_tokenizer(language="fr", task="translate")
        noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32)
        result = model.generate(mx.array(noise * 0.1), temperature=0.0)
        assert hub_calls.calls == []
        assert model.is_multilingual
        assert model.num_languages == 99
        # Whisper's layout: text below the end of text, timestamps last.
        assert tokenizer.eot < tokenizer.sot < tokenizer.language_token
        assert tokenizer.timestamp_begin == 51865 - 1501
        assert tokenizer.sot_sequence == (
            tokenizer.sot,
            tokenizer.language_token,
            tokenizer.translate,
        )
        tokens = [t for segment in result.segments for t in segment["tokens"]]
        text = [t for t in tokens if t < tokenizer.eot]
        assert len(text) > 10
        assert "<|" not in result.text
        assert all(t < 384 or t >= tokenizer.timestamp_begin for t in tokens)

    def test_parakeet_loads_offline_with_its_vocabulary_in_its_config(
        self, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        import mlx.core as mx
        import numpy as np
        from mlx_audio.stt.utils import load_model

        path = make_tiny_transcription(tmp_path / "parakeet", "parakeet")
        model = load_model(str(path))
        noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32)
        result = model.generate(mx.array(noise * 0.1))
        config = json.loads((path / "config.json").read_text())
        assert hub_calls.calls == []
        assert type(model).__name__ == "ParakeetCTC"
        assert not (path / "tokenizer.json").exists()
        assert result.text
        assert {token.text.strip() for s in result.sentences for token in s.tokens} <= {
            piece.replace("\u2581", "") for piece in config["decoder"]["vocabulary"]
        }

    def test_same_seed_is_byte_identical(self, tmp_path: pathlib.Path) -> None:
        first = make_tiny_transcription(tmp_path / "a")
        second = make_tiny_transcription(tmp_path / "b")
        third = make_tiny_transcription(tmp_path / "c", seed=1)
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (first / name).read_bytes() == (second / name).read_bytes()
        weights = (first / "model.safetensors").read_bytes()
        assert weights != (third / "model.safetensors").read_bytes()


class TestEncoderFamilies:
    """The embedding model and the reranker, as mlx-vlm's own loaders load
    them."""

    def test_lists_the_encoder_families(self) -> None:
        assert TINY_EMBEDDING_TYPES == ("bert", "qwen3_vl_embedding")
        assert TINY_RERANKER_TYPES == ("bert",)

    def test_the_embedding_model_gives_unit_vectors_offline(
        self, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        import mlx.core as mx
        from mlx_vlm.embedding_loader import load_embedding_model
        from mlx_vlm.utils import load_processor

        path = make_tiny_embedding(tmp_path / "embedding")
        model = load_embedding_model(path)
        tokenizer = load_processor(path, add_detokenizer=False)
        ids = tokenizer(["a cat", "The quick brown fox"], padding=True)
        out = model(
            mx.array(ids["input_ids"]), attention_mask=mx.array(ids["attention_mask"])
        )
        norms = mx.linalg.norm(out.text_embeds, axis=-1).tolist()
        assert hub_calls.calls == []
        assert out.text_embeds.shape == (2, 64)
        assert norms == pytest.approx([1.0, 1.0], abs=1e-5)
        assert ids["input_ids"][0][0] == 1  # [CLS]
        config = json.loads((path / "config.json").read_text())
        assert config["matryoshka_dimensions"] == [16, 32, 64]

    def test_the_vl_embedding_model_embeds_an_image_offline(
        self, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        """Qwen3-VL-Embedding: the tiny Qwen3-VL with no LM head, an image
        and its chat turn pooled at the last token into one unit vector."""
        import mlx.core as mx
        from mlx_vlm.embedding_loader import load_embedding_model
        from mlx_vlm.prompt_utils import get_chat_template
        from mlx_vlm.utils import load_processor, prepare_inputs

        path = make_tiny_embedding(tmp_path / "vl", "qwen3_vl_embedding")
        model = load_embedding_model(path)
        processor = load_processor(path, add_detokenizer=False)
        turn = [{"role": "user", "content": [{"type": "image"}]}]
        prompt = get_chat_template(processor, turn, add_generation_prompt=True)
        inputs = prepare_inputs(processor, images=[picture()], prompts=prompt)
        out = model(**inputs)
        assert hub_calls.calls == []
        assert type(model).__module__.startswith("mlx_vlm.models.qwen3_vl_embedding")
        assert model.language_model.lm_head is None
        assert inputs["pixel_values"] is not None
        assert out.text_embeds.shape == (1, 64)
        norm = mx.linalg.norm(out.text_embeds, axis=-1).item()
        assert norm == pytest.approx(1.0, abs=1e-5)

    def test_the_reranker_scores_a_pair_with_one_logit_offline(
        self, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        import mlx.core as mx
        from mlx_vlm.reranker_loader import load_reranker

        model, tokenizer = load_reranker(make_tiny_reranker(tmp_path / "reranker"))
        pair = tokenizer("a cat", "a cat on a table", return_tensors="np")
        out = model(
            mx.array(pair["input_ids"]),
            attention_mask=mx.array(pair["attention_mask"]),
            token_type_ids=mx.array(pair["token_type_ids"]),
        )
        assert hub_calls.calls == []
        assert out.logits.shape == (1, 1)
        assert set(pair["token_type_ids"][0].tolist()) == {0, 1}

    def test_same_seed_is_byte_identical(self, tmp_path: pathlib.Path) -> None:
        for make in (make_tiny_embedding, make_tiny_reranker):
            first = make(tmp_path / f"{make.__name__}-a")
            second = make(tmp_path / f"{make.__name__}-b")
            for name in ("model.safetensors", "tokenizer.json", "config.json"):
                assert (first / name).read_bytes() == (second / name).read_bytes()

    def test_the_two_kinds_replace_each_other(self, tmp_path: pathlib.Path) -> None:
        path = make_tiny_embedding(tmp_path / "model")
        make_tiny_reranker(path)
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["BertForSequenceClassification"]
        marker = json.loads((path / "mlx_pinned_tiny_vlm.json").read_text())
        assert marker["generator"] == "mlx_pinned.testing.make_tiny_reranker"

    def test_unknown_families_are_refused(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ValueError, match="bert"):
            make_tiny_embedding(tmp_path, "qwen3")
        with pytest.raises(ValueError, match="bert"):
            make_tiny_reranker(tmp_path, "qwen3")
        assert not any(tmp_path.iterdir())

    def test_the_cached_folders_are_named_by_kind(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("MLX_PINNED_CACHE", str(tmp_path))
        assert tiny_embedding_path() == tmp_path / "tiny-embedding-bert"
        assert tiny_reranker_path() == tmp_path / "tiny-reranker-bert"


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_speech(tmp_path_factory.mktemp("speech") / "model")


class TestSpeechFamily:
    """The text-to-speech model, as mlx-audio's own loader loads it."""

    def test_lists_the_speech_families(self) -> None:
        assert TINY_SPEECH_TYPES == ("qwen3_tts",)

    def test_loads_every_weight_as_written_offline(
        self,
        speech_dir: pathlib.Path,
        hub_calls: HubCalls,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        import mlx.core as mx
        import numpy as np
        from mlx.utils import tree_flatten
        from mlx_audio.tts.utils import load_model

        monkeypatch.setattr(
            sys.modules["mlx_audio.utils"], "snapshot_download", hub_calls.refuse("s")
        )
        model = load_model(speech_dir)
        assert hub_calls.calls == []
        assert model.get_supported_speakers() == ["ryan", "serena", "vivian"]
        assert model.sample_rate == 24000
        parts = [
            (speech_dir / "model.safetensors", model),
            (speech_dir / "speech_tokenizer/model.safetensors", model.speech_tokenizer),
        ]
        for file, module in parts:
            held = dict(tree_flatten(module.parameters()))
            for name, value in mx.load(str(file)).items():
                # mlx-audio guesses each convolution's layout from its shape:
                # none is turned round.
                assert np.array_equal(np.array(held[name]), np.array(value)), name

    def test_speaks_greedily_to_its_frame_limit_streamed_or_whole(
        self, speech_dir: pathlib.Path
    ) -> None:
        import numpy as np
        from mlx_audio.tts.utils import load_model

        model = load_model(speech_dir)

        def audio(voice: str = "vivian", **kwargs: Any) -> Any:
            results = model.generate(
                "Hello there.", voice=voice, max_tokens=12, **kwargs
            )
            return np.concatenate([np.array(result.audio) for result in results])

        streamed = audio(stream=True, streaming_interval=0.32)
        whole = audio()
        assert streamed.shape == (12 * 1920,)  # 12 frames, 1920 samples each
        assert np.array_equal(streamed, whole)
        assert np.array_equal(audio(), whole)
        assert not np.array_equal(audio("ryan"), whole)
        assert not np.array_equal(audio(instruct="Very happy."), whole)

    def test_same_seed_is_byte_identical(self, tmp_path: pathlib.Path) -> None:
        first = make_tiny_speech(tmp_path / "a")
        second = make_tiny_speech(tmp_path / "b")
        other = make_tiny_speech(tmp_path / "c", seed=1)
        names = ["model.safetensors", "speech_tokenizer/model.safetensors"]
        for name in [*names, "tokenizer.json", "config.json"]:
            assert (first / name).read_bytes() == (second / name).read_bytes()
        for name in names:
            assert (first / name).read_bytes() != (other / name).read_bytes()
        marker = json.loads((first / "mlx_pinned_tiny_vlm.json").read_text())
        assert marker["generator"] == "mlx_pinned.testing.make_tiny_speech"

    def test_unknown_families_are_refused(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ValueError, match="qwen3_tts"):
            make_tiny_speech(tmp_path, "kokoro")
        assert not any(tmp_path.iterdir())

    def test_the_cached_folder_is_named_by_family(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("MLX_PINNED_CACHE", str(tmp_path))
        assert tiny_speech_path() == tmp_path / "tiny-speech-qwen3_tts"


FRESH_PROCESS = textwrap.dedent(
    """
    import json, socket, sys
    from concurrent.futures import ThreadPoolExecutor

    def refuse(*args, **kwargs):
        raise OSError("network access from an offline test")

    socket.socket.connect = refuse

    from mlx_pinned.testing import make_test_image, make_tiny_vlm

    path = sys.argv[1]
    # Built on worker threads: the process must still exit cleanly.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: make_tiny_vlm(path), range(4)))

    import io
    import mlx_vlm
    from PIL import Image

    model, processor = mlx_vlm.load(path)
    prompt = mlx_vlm.apply_chat_template(
        processor, model.config, "Describe this image in one sentence.",
        num_images=1,
    )
    image = Image.open(io.BytesIO(make_test_image()))
    result = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=8)
    print(json.dumps(result.token_ids))
    """
)


# Each tool-format family: mlx-vlm's class it is written with, and tokens
# its tokenizer keeps whole.
TOOL_FAMILIES = {
    "llama3_tools": ("llama", ("<|python_tag|>", "<|eot_id|>", "<|eom_id|>")),
    "mistral_tools": ("llama", ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[INST]")),
    "gpt_oss_harmony": ("llama", ("<|channel|>", "<|message|>", "<|call|>")),
    "qwen3_coder": ("qwen3", ("<|im_start|>", "<|im_end|>")),
}


class TestToolFamilies:
    def test_lists_the_tool_format_families(self) -> None:
        assert TINY_TOOL_LM_TYPES == tuple(TOOL_FAMILIES)
        assert not set(TINY_TOOL_LM_TYPES) & set(TINY_LM_TYPES)

    @pytest.mark.slow
    @pytest.mark.parametrize("family", TINY_TOOL_LM_TYPES)
    def test_each_generates_offline_with_its_special_tokens(
        self, family: str, tmp_path: pathlib.Path, hub_calls: HubCalls
    ) -> None:
        path = make_tiny_lm(tmp_path / "model", family)
        result = generate_offline(path, images=0, max_tokens=12)
        assert hub_calls.calls == []
        assert result.generation_tokens == 12
        model_type, specials = TOOL_FAMILIES[family]
        assert json.loads((path / "config.json").read_text())["model_type"] == (
            model_type
        )
        marker = json.loads((path / "mlx_pinned_tiny_vlm.json").read_text())
        assert (marker["model_type"], marker["family"]) == (model_type, family)
        _, processor = mlx_vlm.load(str(path))
        tokenizer = getattr(processor, "tokenizer", processor)
        for token in specials:
            assert len(tokenizer.encode(token, add_special_tokens=False)) == 1

    def test_a_tool_family_replaces_its_plain_family(
        self, tmp_path: pathlib.Path
    ) -> None:
        path = make_tiny_lm(tmp_path / "model", "llama")
        plain = json.loads((path / "mlx_pinned_tiny_vlm.json").read_text())
        assert "family" not in plain
        make_tiny_lm(path, "llama3_tools")
        config = json.loads((path / "tokenizer_config.json").read_text())
        assert "<|python_tag|>" in json.dumps(config["added_tokens_decoder"])
        assert '"parameters": ' in config["chat_template"]

    def test_the_cached_folders_are_named_by_family(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("MLX_PINNED_CACHE", str(tmp_path))
        assert tiny_lm_path("qwen3_coder") == tmp_path / "tiny-lm-qwen3_coder"


@pytest.fixture(scope="module")
def fresh_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], pathlib.Path]:
    """Build, load and run the model in a new, offline Python process."""
    root = tmp_path_factory.mktemp("fresh")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),  # an empty hub cache
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    completed = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(root / "model")],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        check=False,
    )
    return completed, root / "model"


class TestInAFreshProcess:
    @pytest.mark.slow
    def test_exits_cleanly_after_building_on_worker_threads(
        self,
        fresh_process: tuple[subprocess.CompletedProcess[str], pathlib.Path],
    ) -> None:
        completed, _ = fresh_process
        assert completed.returncode == 0, completed.stderr[-2000:]

    def test_builds_the_same_bytes(
        self,
        fresh_process: tuple[subprocess.CompletedProcess[str], pathlib.Path],
        model_dir: pathlib.Path,
    ) -> None:
        _, path = fresh_process
        assert read_all(path) == read_all(model_dir)

    def test_generates_the_same_tokens(
        self,
        fresh_process: tuple[subprocess.CompletedProcess[str], pathlib.Path],
        loaded: tuple[Any, Any],
    ) -> None:
        completed, _ = fresh_process
        tokens, _ = greedy(loaded, picture(), max_tokens=8)
        assert json.loads(completed.stdout.splitlines()[-1]) == tokens


class TestTinyVlmPath:
    def test_writes_once_under_the_cache_dir(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("MLX_PINNED_CACHE", str(tmp_path))
        path = tiny_vlm_path()
        assert path == tmp_path / "tiny-vlm"
        assert {p.name for p in path.iterdir()} == MODEL_FILES
        inode = path.stat().st_ino
        assert tiny_vlm_path() == path
        assert path.stat().st_ino == inode

    def test_defaults_to_the_user_cache(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("MLX_PINNED_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))
        assert tiny_vlm_path() == tmp_path / ".cache" / "mlx-pinned" / "tiny-vlm"


class TestTestImages:
    @pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "jpg"])
    def test_encodes_the_requested_size_and_format(self, fmt: str) -> None:
        image = Image.open(io.BytesIO(make_test_image(48, 32, fmt)))
        assert image.size == (48, 32)
        assert image.format == {"JPG": "JPEG"}.get(fmt.upper(), fmt.upper())

    def test_is_deterministic_per_seed(self) -> None:
        assert make_test_image(seed=5) == make_test_image(seed=5)
        assert make_test_image(seed=5) != make_test_image(seed=6)

    def test_rejects_an_empty_image(self) -> None:
        with pytest.raises(ValueError, match="positive"):
            make_test_image(0, 64)

    def test_data_uri_carries_the_image(self) -> None:
        uri = image_data_uri(32, 32, "PNG", seed=2)
        head, _, data = uri.partition(",")
        assert head == "data:image/png;base64"
        assert base64.b64decode(data) == make_test_image(32, 32, "PNG", seed=2)

    def test_data_uri_loads_in_mlx_vlm(self) -> None:
        from mlx_vlm.utils import load_image

        assert load_image(image_data_uri()).size == (64, 64)

    def test_data_uri_rejects_unknown_formats(self) -> None:
        with pytest.raises(ValueError, match="data URI"):
            image_data_uri(fmt="BMP")


class TestImport:
    def test_all_is_sorted_and_matches_the_public_names(self) -> None:
        names = mlx_pinned.testing.__all__
        public = {
            name
            for name, value in vars(mlx_pinned.testing).items()
            if not name.startswith("_")
            and name != "annotations"
            and not isinstance(value, type(mlx_pinned.testing))
        }
        # ruff's RUF022 order: constants first, then the rest.
        assert names == sorted(names, key=lambda name: (not name.isupper(), name))
        assert set(names) == public

    def test_is_cheap(self) -> None:
        code = (
            "import sys, mlx_pinned.testing\n"
            "heavy = {'mlx_vlm', 'tokenizers', 'transformers', 'PIL'}\n"
            "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        completed = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=60,
        )
        assert completed.stdout.strip() == "[]"
