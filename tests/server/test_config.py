"""The settings: declared once, resolved per model (``for_model``) into the
one value every loader takes, and documented from their declarations."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import create_app
from mlx_pinned.server.cli_options import settings_table, table_in
from mlx_pinned.server.config import (
    PER_MODEL_SETTINGS,
    ModelSettings,
    ServerConfig,
    SettingError,
)
from mlx_pinned.server.engine import BatchEngine, DraftSettings
from mlx_pinned.server.http.served_models import ServedModel
from mlx_pinned.server.kinds import KINDS, kind_named
from mlx_pinned.testing import (
    tiny_embedding_path,
    tiny_lm_path,
    tiny_reranker_path,
    tiny_speech_path,
    tiny_transcription_path,
    tiny_vlm_path,
)

from .kit import widen

DOCS = Path(__file__).parents[2] / "docs" / "server.md"
NAME = "m"


def load_of(kind: str) -> Callable[[ModelSettings, MLXThread], Any]:
    """The kind's loader, as the app calls it."""
    load = kind_named(kind).load
    assert load is not None
    return load


# Each per-model setting: a value other than its default, and the settings
# it needs beside it to show (the chat ones, on a chat model only).
VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    "load_on_first_use": (True, {}),
    "idle_unload_timeout": (30.0, {"load_on_first_use": True}),
    "pinned": (True, {}),
    "max_num_seqs": (3, {}),
    "max_pending": (5, {}),
    "tool_call_parser": ("hermes", {}),
    "reasoning_parser": ("think", {}),
    "prompt_cache_bytes": (12345, {}),
    "image_cache_bytes": (23456, {}),
    "prefill_step_size": (64, {}),
    "prefill_step_seconds": (0.5, {}),
    "prefill_checkpoint_tokens": (96, {}),
    "abandoned_prefill_tokens": (77, {}),
    "kv_bits": (8, {}),
    "kv_group_size": (32, {"kv_bits": 8}),
    "prompt_lookup_tokens": (2, {}),
    "num_draft_tokens": (5, {"prompt_lookup_tokens": 2}),
    "draft_max_batch": (7, {"prompt_lookup_tokens": 2}),
    "draft_model": (str(tiny_lm_path()), {}),
    "mtp": (False, {}),
}
# Where a served model shows a setting (any kind).
SERVED: dict[str, Callable[[ServedModel], Any]] = {
    "model_kind": lambda served: served.kind,
    "load_on_first_use": lambda served: not served.slot.at_start_up,
    "idle_unload_timeout": lambda served: served.slot.idle_timeout,
    "pinned": lambda served: served.slot.pinned,
    "max_num_seqs": lambda served: served.gate.max_num_seqs,
    "max_pending": lambda served: served.gate.max_pending,
}


def mtp(engine: BatchEngine) -> bool:
    drafting = engine.loop.state.decoder.drafting
    return drafting is not None and drafting.settings.mtp


def drafts(engine: BatchEngine) -> DraftSettings:
    drafting = engine.loop.state.decoder.drafting
    assert drafting is not None
    return drafting.settings


# Where an engine of a kind shows a setting.
ENGINE: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("tool_call_parser", "chat"): lambda engine: engine.facts.formats.tool_call.name,
    ("reasoning_parser", "chat"): lambda engine: engine.facts.formats.reasoning.name,
    ("prompt_cache_bytes", "chat"): lambda engine: engine.prompt_cache.budget,
    ("image_cache_bytes", "chat"): lambda engine: engine.image_cache.held.budget,
    ("prefill_step_size", "chat"): lambda engine: engine.loop.state.prefill_step,
    ("prefill_step_seconds", "chat"): lambda engine: engine.loop.state.pacer.budget,
    ("prefill_checkpoint_tokens", "chat"): lambda engine: (
        engine.loop.state.prefills.settings.checkpoint
    ),
    ("abandoned_prefill_tokens", "chat"): lambda engine: (
        engine.loop.state.prefills.settings.abandoned
    ),
    ("kv_bits", "chat"): lambda engine: engine.loop.state.kv_quant.bits,
    ("kv_group_size", "chat"): lambda engine: engine.loop.state.kv_quant.group_size,
    ("prompt_lookup_tokens", "chat"): lambda engine: drafts(engine).ngram,
    ("num_draft_tokens", "chat"): lambda engine: drafts(engine).tokens,
    ("draft_max_batch", "chat"): lambda engine: drafts(engine).max_batch,
    ("draft_model", "chat"): lambda engine: drafts(engine).model,
    ("mtp", "chat"): mtp,
    ("prefill_step_seconds", "embedding"): lambda engine: engine.loop.pacer.budget,
    ("prefill_step_seconds", "rerank"): lambda engine: engine.loop.pacer.budget,
}


@pytest.fixture(scope="module")
def thread() -> Iterator[MLXThread]:
    with MLXThread(name="config-test") as running:
        yield running


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A model of each kind; the chat model's heads take ``kv_bits``."""
    wide = widen(tiny_vlm_path(), tmp_path_factory.mktemp("wide") / "vision")
    return {
        "chat": str(wide),
        "embedding": str(tiny_embedding_path()),
        "rerank": str(tiny_reranker_path()),
        "transcription": str(tiny_transcription_path()),
        "speech": str(tiny_speech_path()),
    }


def test_the_docs_table_is_what_the_declarations_give() -> None:
    assert table_in(DOCS.read_text()) == settings_table(), (
        "docs/server.md's table of settings differs from the declarations in "
        "server/config.py: run python -m mlx_pinned.server.cli_options "
        "docs/server.md"
    )


def test_every_per_model_setting_is_a_field_of_model_settings_and_shows() -> None:
    fields = {item.name for item in dataclasses.fields(ModelSettings)}
    assert PER_MODEL_SETTINGS - {"model_kind"} <= fields
    for kind in KINDS.values():
        assert kind.settings <= PER_MODEL_SETTINGS, kind.name
    shown = set(SERVED) | {name for name, _ in ENGINE}
    assert shown == PER_MODEL_SETTINGS  # a new one needs its place below
    assert set(VALUES) == PER_MODEL_SETTINGS - {"model_kind"}


@pytest.mark.parametrize("name", sorted(PER_MODEL_SETTINGS))
def test_each_loader_is_built_from_for_model_with_each_setting(
    name: str, paths: dict[str, str], thread: MLXThread
) -> None:
    value, beside = VALUES.get(name, (None, {}))
    for kind, path in paths.items():
        own: dict[str, Any] = {"model_kind": kind}
        if name != "model_kind":
            own[name] = value
            own.update(
                (other, given)
                for other, given in beside.items()
                if kind_named(kind).honours(other)
            )
        make = functools.partial(
            ServerConfig, model=path, served_model_name=NAME, model_settings=(own,)
        )
        if not kind_named(kind).honours(name):
            with pytest.raises(SettingError, match=f"{name} is not a setting of"):
                make()
            continue
        config = make()
        expected = kind if name == "model_kind" else value
        settings = config.for_model(0)
        field = "kind" if name == "model_kind" else name
        assert getattr(settings, field) == expected
        if name in SERVED:
            served = create_app(config=config).state.models.get(NAME)
            assert SERVED[name](served) == expected, kind
        engine = thread.run_sync(load_of(kind), settings, thread)
        assert engine.loaded.path == path
        if (name, kind) in ENGINE:
            assert ENGINE[name, kind](engine) == expected, kind


class TestModelSettings:
    def test_the_budgets_are_resolved_and_shared_out(self) -> None:
        config = ServerConfig(model=("a", "b"), model_settings=({}, {"kv_bits": 8}))
        first, second = config.for_model(0), config.for_model(1)
        assert first.prompt_cache_bytes == config.prompt_cache_budget > 0
        assert first.image_cache_bytes == config.image_cache_budget > 0
        assert (first.kv_bits, second.kv_bits) == (None, 8)
        assert (first.name, first.path, first.kind) == ("a", "a", "chat")

    def test_the_disk_tier_is_a_folder_under_state_dir(self, tmp_path: Path) -> None:
        on = ModelSettings.of("m", state_dir=str(tmp_path))
        assert on.prompt_cache_dir == tmp_path / "prompt_cache"
        off = ModelSettings.of("m", state_dir=str(tmp_path), prompt_cache_disk_bytes=0)
        assert off.prompt_cache_dir is None
        assert ModelSettings.of("m").prompt_cache_dir is None

    def test_a_model_of_another_kind_takes_no_chat_setting_of_the_servers(
        self,
    ) -> None:
        config = ServerConfig(
            model=("c", "e"),
            model_settings=({}, {"model_kind": "embedding"}),
            prompt_lookup_tokens=2,
            tool_call_parser="hermes",
        )
        chat, embedding = config.for_model(0), config.for_model(1)
        assert (chat.prompt_lookup_tokens, chat.tool_call_parser) == (2, "hermes")
        defaults = ModelSettings.of("d")
        for name in ("prompt_lookup_tokens", "tool_call_parser"):
            assert getattr(embedding, name) == getattr(defaults, name)


class TestDistributed:
    def test_the_disk_tier_is_refused_naming_both_settings(
        self, tmp_path: Path
    ) -> None:
        with pytest.raises(SettingError) as refused:
            ServerConfig(model="m", distributed="tensor", state_dir=str(tmp_path))
        message = str(refused.value)
        assert refused.value.setting == "state_dir"
        assert "distributed" in message
        assert "prompt_cache_disk_bytes 0" in message

    def test_the_state_dir_holds_the_responses_without_the_disk_tier(
        self, tmp_path: Path
    ) -> None:
        settings = ModelSettings.of(
            "m",
            distributed="tensor",
            state_dir=str(tmp_path),
            prompt_cache_disk_bytes=0,
        )
        assert settings.distributed == "tensor"
        assert settings.prompt_cache_dir is None
