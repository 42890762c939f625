from __future__ import annotations

import io
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from mlx_pinned import MLXThread
from mlx_pinned.server import engine
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.answers import StopMatcher
from mlx_pinned.server.engine.model_inputs import build_prompt
from mlx_pinned.server.events import FinalEvent, GenerationParams, TokenEvent
from mlx_pinned.server.http.chat_completions.messages import chat_messages
from mlx_pinned.server.http.chat_completions.protocol import parse_chat_request
from mlx_pinned.testing import make_test_image

from .kit import generate_inline, generation

PROMPT = "Describe this image in one sentence."


@pytest.fixture(scope="module")
def loaded(tiny_model_path: Path) -> LoadedModel:
    # Loaded and used on this (main) thread: the engine itself is thread-agnostic.
    return engine.load(tiny_model_path)


@pytest.fixture(scope="module")
def image() -> Image.Image:
    return Image.open(io.BytesIO(make_test_image())).convert("RGB")


def vision_messages() -> tuple[dict[str, Any], ...]:
    return (
        {
            "role": "user",
            "content": [{"type": "text", "text": PROMPT}, {"type": "image_url"}],
        },
    )


_engines: weakref.WeakKeyDictionary[LoadedModel, BatchEngine] = (
    weakref.WeakKeyDictionary()
)


def engine_of(loaded: LoadedModel) -> BatchEngine:
    """One engine per model; these tests run its generators on this thread
    (the engine is thread-agnostic), so its MLX thread is never started."""
    if loaded not in _engines:
        _engines[loaded] = BatchEngine(loaded, MLXThread(name="test-engine-unused"))
    return _engines[loaded]


def run(
    loaded: LoadedModel, image: Image.Image | None = None, **params: Any
) -> tuple[list[TokenEvent], FinalEvent]:
    params.setdefault("messages", vision_messages())
    params.setdefault("max_tokens", 12)
    params.setdefault("temperature", 0.0)
    images = [image] if image is not None else []
    stream = generate_inline(engine_of(loaded), generation(**params), images)
    events = list(stream)
    final = events[-1]
    assert isinstance(final, FinalEvent)
    tokens = [e for e in events[:-1] if isinstance(e, TokenEvent)]
    assert len(tokens) == len(events) - 1
    return tokens, final


def text_of(tokens: list[TokenEvent], final: FinalEvent) -> str:
    return "".join(e.text for e in tokens) + final.text


class TestChatMessages:
    def test_roles_and_parts(self) -> None:
        raw = (
            b'{"model": "m", "messages": ['
            b'{"role": "developer", "content": [{"type": "text", "text": "a"},'
            b' {"type": "text", "text": "b"}]},'
            b'{"role": "user", "content": [{"type": "image_url", "image_url": "x"},'
            b' {"type": "text", "text": "hi"}]},'
            b'{"role": "assistant", "content": null},'
            b'{"role": "user", "content": "more"}]}'
        )
        messages = chat_messages(parse_chat_request(raw).messages)
        assert messages == [
            {"role": "system", "content": "ab"},
            {
                "role": "user",
                "content": [{"type": "image_url"}, {"type": "text", "text": "hi"}],
            },
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "more"},
        ]


class TestBuildPrompt:
    def test_images_in_earlier_turns_stay_there(self, loaded: LoadedModel) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "image_url"}, {"type": "text", "text": "one"}],
            },
            {"role": "assistant", "content": "A picture."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "two"}, {"type": "image_url"}],
            },
        ]
        prompt = build_prompt(loaded, messages)
        assert prompt.count("<|image_pad|>") == 2
        first, second = prompt.split("A picture.")
        assert "<|image_pad|>" in first
        assert "<|image_pad|>" in second
        assert prompt.index("Be brief.") < prompt.index("one")
        assert prompt.endswith("<|im_start|>assistant\n")


class TestStopMatcher:
    def test_holds_back_a_possible_prefix(self) -> None:
        matcher = StopMatcher(["STOP"])
        assert matcher.feed("abcST") == ("abc", False)
        assert matcher.feed("x") == ("STx", False)
        assert matcher.feed("S") == ("", False)
        assert matcher.feed("TOP and more") == ("", True)

    def test_earliest_stop_wins(self) -> None:
        matcher = StopMatcher(["world", "lo w"])
        assert matcher.feed("hello world") == ("hel", True)
        assert matcher.hit == "lo w"

    def test_flush_releases_held_text(self) -> None:
        matcher = StopMatcher(["ab"])
        assert matcher.feed("xa") == ("x", False)
        assert matcher.flush() == "a"

    def test_no_stops_passes_through(self) -> None:
        matcher = StopMatcher([])
        assert matcher.feed("anything") == ("anything", False)
        assert matcher.hit is None

    @given(
        chunks=st.lists(st.text("abc", max_size=4), max_size=12),
        stops=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=4),
    )
    def test_output_is_text_cut_at_first_stop(
        self, chunks: list[str], stops: list[str]
    ) -> None:
        matcher = StopMatcher(stops)
        out, stopped = "", False
        for chunk in chunks:
            text, stopped = matcher.feed(chunk)
            out += text
            if stopped:
                break
        if not stopped:
            out += matcher.flush()
        full = "".join(chunks)
        cuts = [i for i in (full.find(s) for s in stops) if i >= 0]
        assert stopped == bool(cuts)
        assert out == (full[: min(cuts)] if cuts else full)


class TestLoad:
    def test_loaded_on_another_thread_runs_here(self, tiny_model_path: Path) -> None:
        # Everything is evaluated at load: a model loaded on the MLX thread can
        # be run on this one without "There is no Stream".
        with MLXThread(name="engine-load", eval_results=False) as thread:
            other = thread.run_sync(engine.load, tiny_model_path)
        assert other.parameters > 100_000
        assert other.load_seconds > 0
        _, final = run(other, max_tokens=3)
        assert final.completion_tokens == 3

    def test_missing_model_raises(self, tmp_path: Path) -> None:
        with pytest.raises(Exception):  # noqa: B017, PT011 - mlx-vlm's own error
            engine.load(tmp_path / "nothing-here")


class TestGenerate:
    def test_runs_to_max_tokens(self, loaded: LoadedModel, image: Image.Image) -> None:
        tokens, final = run(loaded, image, max_tokens=7)
        assert len(tokens) == 7
        assert final.finish_reason == "length"
        assert final.completion_tokens == 7
        assert final.prompt_tokens > 10  # text plus image tokens
        assert final.prefill_seconds > 0
        assert text_of(tokens, final)

    def test_image_tokens_counted(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        _, with_image = run(loaded, image, max_tokens=1)
        text_only = ({"role": "user", "content": PROMPT},)
        _, without = run(loaded, messages=text_only, max_tokens=1)
        assert with_image.prompt_tokens > without.prompt_tokens + 3

    def test_text_streams_per_token(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        tokens, final = run(loaded, image, max_tokens=10, logprobs=True)
        assert sum(1 for e in tokens if e.text) >= 5
        expected = b"".join(bytes(e.logprobs.bytes) for e in tokens if e.logprobs)
        assert text_of(tokens, final) == expected.decode("utf-8", errors="replace")

    def test_greedy_is_deterministic(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        first = run(loaded, image, logprobs=True)
        second = run(loaded, image, logprobs=True)
        assert first == second

    def test_seed_reproduces_sampling(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        def sample(seed: int) -> str:
            tokens, final = run(
                loaded, image, temperature=1.5, seed=seed, max_tokens=16
            )
            return text_of(tokens, final)

        assert sample(7) == sample(7)
        assert len({sample(s) for s in range(4)}) > 1

    def test_logprobs(self, loaded: LoadedModel, image: Image.Image) -> None:
        tokens, _ = run(loaded, image, logprobs=True, top_logprobs=5)
        for event in tokens:
            lp = event.logprobs
            assert lp is not None
            assert len(lp.top) == 5
            values = [v for _, v, _ in lp.top]
            assert values == sorted(values, reverse=True)
            # Greedy: the chosen token is the most likely one.
            assert lp.top[0][0] == lp.token
            assert lp.top[0][1] == pytest.approx(lp.logprob)
            assert lp.logprob <= 0
            assert bytes(lp.bytes).decode("utf-8", "backslashreplace") == lp.token

    def test_no_logprobs_unless_asked(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        tokens, _ = run(loaded, image)
        assert all(e.logprobs is None for e in tokens)
        tokens, _ = run(loaded, image, logprobs=True)
        assert all(e.logprobs is not None and e.logprobs.top == [] for e in tokens)

    def test_stop_string_cuts_and_is_not_included(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        full = text_of(*run(loaded, image, max_tokens=20))
        stop = full[5:8]
        tokens, final = run(loaded, image, max_tokens=20, stop=("zzz", stop))
        text = text_of(tokens, final)
        assert final.finish_reason == "stop"
        assert text == full[: full.index(stop)]
        assert stop not in text
        assert final.completion_tokens < 20

    def test_end_of_turn_is_stop(self, loaded: LoadedModel, image: Image.Image) -> None:
        im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
        tokens, final = run(loaded, image, logit_bias=((im_end, 100.0),))
        assert final.finish_reason == "stop"
        assert final.completion_tokens == 0
        assert tokens == []
        assert final.text == ""

    def test_multi_image_multi_turn(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        def turn(text: str) -> dict[str, Any]:
            parts = [{"type": "image_url"}, {"type": "text", "text": text}]
            return {"role": "user", "content": parts}

        one = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})
        two = (turn("a"), {"role": "assistant", "content": "b"}, turn("c"))
        params = generation(two, max_tokens=2, temperature=0.0)
        events = list(generate_inline(engine_of(loaded), params, [image, image]))
        final = events[-1]
        assert isinstance(final, FinalEvent)
        assert final.completion_tokens == 2
        _, single = run(loaded, image, messages=(*one, turn("c")), max_tokens=2)
        # The image of the first turn still counts: 4 more image tokens.
        assert final.prompt_tokens >= single.prompt_tokens + 4

    def test_close_takes_the_row_out(
        self, loaded: LoadedModel, image: Image.Image
    ) -> None:
        batch = engine_of(loaded)
        gen = generate_inline(
            batch, GenerationParams(vision_messages(), max_tokens=50), [image]
        )
        next(gen)
        stats = batch.statistics()
        assert stats.active + stats.joining == 1
        gen.close()
        stats = batch.statistics()
        assert (stats.active, stats.joining) == (0, 0)


def test_events_hold_no_mlx_arrays(loaded: LoadedModel, image: Image.Image) -> None:
    import dataclasses

    import mlx.core as mx

    tokens, final = run(loaded, image, logprobs=True, top_logprobs=2)

    def walk(value: object) -> Iterator[object]:
        yield value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                yield from walk(getattr(value, f.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item)

    leaves = [v for e in [*tokens, final] for v in walk(e)]
    assert not any(isinstance(v, mx.array) for v in leaves)
    assert threading.current_thread() is threading.main_thread()
