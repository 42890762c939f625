"""Tests for mlx_pinned.testing's bench models: the tiny families at a small
real model's proportions, written offline."""

from __future__ import annotations

import importlib
import io
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from mlx_pinned import MLXThread
from mlx_pinned.server.config import ModelSettings
from mlx_pinned.server.engine import BatchEngine
from mlx_pinned.server.events import (
    FinalEvent,
    GenerationParams,
    SamplingParams,
    TokenEvent,
)
from mlx_pinned.testing import (
    BENCH_LM_TYPES,
    BENCH_MODEL_TYPES,
    SPECIAL_TOKENS,
    bench_vlm_path,
    make_bench_lm,
    make_bench_vlm,
    make_test_image,
    tiny_vlm_path,
)

mlx_vlm: Any = importlib.import_module("mlx_vlm")
PROMPT = "Describe this image in one sentence."
VOCAB = 32768
# The decoder every bench family shares.
DECODER = {
    "num_hidden_layers": 6,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": VOCAB,
}


@pytest.fixture(scope="session")
def bench_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """The bench Qwen3-VL, written once per session into its own cache."""
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("bench-cache")
        patch.setenv("MLX_PINNED_CACHE", str(cache))
        path = bench_vlm_path()
        assert path == cache / "bench-vlm-qwen3_vl"
        yield path


@pytest.fixture(scope="session")
def bench_loaded(bench_path: pathlib.Path) -> tuple[Any, Any]:
    return mlx_vlm.load(str(bench_path))


def parameters(module: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(value.size for _, value in tree_flatten(module.parameters()))


class TestBenchModel:
    def test_lists_the_benchmarked_families(self) -> None:
        assert BENCH_MODEL_TYPES == ("qwen3_vl", "qwen3_5", "gemma3", "gemma4")
        assert BENCH_LM_TYPES == ("qwen3",)

    def test_has_a_small_real_models_proportions(
        self, bench_path: pathlib.Path
    ) -> None:
        config = json.loads((bench_path / "config.json").read_text())
        text = config["text_config"]
        assert {key: text[key] for key in DECODER} == DECODER
        assert text["tie_word_embeddings"] is True
        assert config["vision_config"]["out_hidden_size"] == 512
        assert config["dtype"] == "bfloat16"
        marker = json.loads((bench_path / "mlx_pinned_tiny_vlm.json").read_text())
        assert marker["generator"] == "mlx_pinned.testing.make_bench_vlm"
        assert marker["size"] == "bench"

    def test_loads_with_its_parameters_in_bfloat16(
        self, bench_loaded: tuple[Any, Any]
    ) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        model, _ = bench_loaded
        decoder = model.language_model
        # 6 layers of 3.1M, and the 16.8M of the tied embeddings.
        assert 35_000_000 < parameters(decoder) < 36_500_000
        assert 2_000_000 < parameters(model.vision_tower) < 10_000_000
        dtypes = {value.dtype for _, value in tree_flatten(model.parameters())}
        assert dtypes == {mx.bfloat16}

    def test_the_vocabulary_is_padded_around_the_tiny_one(
        self, bench_loaded: tuple[Any, Any]
    ) -> None:
        _, processor = bench_loaded
        tokenizer = processor.tokenizer
        _, tiny = mlx_vlm.load(str(tiny_vlm_path()))
        assert len(tokenizer) == VOCAB
        # Text encodes as in the tiny model: no text makes a padding word.
        assert tokenizer.encode(PROMPT) == tiny.tokenizer.encode(PROMPT)
        for index, token in enumerate(SPECIAL_TOKENS):
            assert tokenizer.convert_tokens_to_ids(token) == index
        words = tokenizer.decode(list(range(VOCAB - 3, VOCAB)))
        assert len(words.split()) == 3
        assert words.replace(" ", "").isalpha()
        messages = [{"role": "user", "content": "Hi"}]
        assert tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ) == tiny.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    @pytest.mark.anyio
    async def test_answers_a_greedy_request_through_the_engine(
        self, bench_path: pathlib.Path
    ) -> None:
        image = Image.open(io.BytesIO(make_test_image())).convert("RGB")
        content = [{"type": "text", "text": PROMPT}, {"type": "image_url"}]
        params = GenerationParams(
            ({"role": "user", "content": content},),
            max_tokens=4,
            sampling=SamplingParams(temperature=0.0, logprobs=True),
        )

        async def answer(engine: BatchEngine) -> tuple[list[str], FinalEvent]:
            tokens: list[str] = []
            async with engine.stream(params, [image]) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        assert event.logprobs is not None
                        tokens.append(event.logprobs.token)
                    elif isinstance(event, FinalEvent):
                        return tokens, event
            raise AssertionError("the stream ended without a final event")

        async with MLXThread(name="bench-engine") as thread:
            settings = ModelSettings.of(bench_path)
            engine = await thread.run(BatchEngine.load, settings, thread)
            first, final = await answer(engine)
            again, _ = await answer(engine)
        assert final.completion_tokens == 4
        assert len(first) == 4
        assert first == again
        assert not set(first) & set(SPECIAL_TOKENS)
        # The image's 4 tokens between the vision markers, and the text.
        assert final.prompt_tokens > 4 + 4


class TestBenchFamilies:
    @pytest.mark.slow
    @pytest.mark.parametrize("model_type", BENCH_MODEL_TYPES + BENCH_LM_TYPES)
    def test_each_family_generates_offline_at_its_size(
        self, model_type: str, tmp_path: pathlib.Path
    ) -> None:
        from PIL import Image

        vision = model_type in BENCH_MODEL_TYPES
        if vision:
            path = make_bench_vlm(tmp_path / "model", model_type=model_type)
        else:
            path = make_bench_lm(tmp_path / "model", model_type)
        config = json.loads((path / "config.json").read_text())
        text = config.get("text_config", config)
        assert text["hidden_size"] == 512
        assert text["num_hidden_layers"] == 6
        assert text["vocab_size"] == config["vocab_size"] == VOCAB
        model, processor = mlx_vlm.load(str(path))
        assert len(getattr(processor, "tokenizer", processor)) == VOCAB
        prompt = mlx_vlm.apply_chat_template(
            processor, model.config, PROMPT, num_images=int(vision)
        )
        image = [Image.open(io.BytesIO(make_test_image()))] if vision else None
        result = mlx_vlm.generate(model, processor, prompt, image=image, max_tokens=4)
        assert result.generation_tokens == 4

    def test_unknown_families_are_refused(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(ValueError, match="qwen3_vl"):
            make_bench_vlm(tmp_path, model_type="smolvlm")
        with pytest.raises(ValueError, match="qwen3"):
            make_bench_lm(tmp_path, "llama")
        assert not any(tmp_path.iterdir())
