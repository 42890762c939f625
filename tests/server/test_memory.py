"""A model's weight bytes before and after it loads, the start-up budget
check, and releasing an engine's memory on the MLX thread."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.config import ModelSettings
from mlx_pinned.server.engine import BatchEngine
from mlx_pinned.server.engine.memory import (
    check_start_up_budget,
    release,
    stored_weight_bytes,
)

HEADERS = 64 * 1024  # the safetensors JSON headers: the checkpoint's overhead


class TestWeightBytes:
    def test_the_checkpoint_measures_what_loads(self, tiny_model_path: Path) -> None:
        stored = stored_weight_bytes(tiny_model_path)
        thread = MLXThread(name="memory-test")
        try:
            settings = ModelSettings.of(tiny_model_path)
            engine = thread.run_sync(BatchEngine.load, settings, thread)
            loaded = engine.weight_bytes
            parameters = engine.loaded.parameters
        finally:
            thread.shutdown()
        assert loaded == 4 * parameters  # float32
        assert loaded <= stored <= loaded + HEADERS

    def test_a_folder_without_weights_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
            stored_weight_bytes(tmp_path)

    def test_the_start_up_budget(self, tiny_model_path: Path) -> None:
        one = stored_weight_bytes(tiny_model_path)
        paths = (str(tiny_model_path),) * 2
        assert check_start_up_budget(paths, 2 * one) == 2 * one
        with pytest.raises(ValueError, match=f"hold {2 * one} bytes.*\\({one}\\)"):
            check_start_up_budget(paths, one)


class TestRelease:
    def test_the_engine_is_freed_on_the_thread(self, tiny_model_path: Path) -> None:
        thread = MLXThread(name="memory-test")
        try:
            settings = ModelSettings.of(tiny_model_path)
            holder: list[Any] = [thread.run_sync(BatchEngine.load, settings, thread)]
            model = weakref.ref(holder[0].loaded.model)
            weights = holder[0].weight_bytes
            released = thread.run_sync(release, holder, "tiny")
        finally:
            thread.shutdown()
        assert holder == []
        assert model() is None
        assert released.freed >= weights
        assert released.cache_after == 0
