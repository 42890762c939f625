from __future__ import annotations

from pathlib import Path

import pytest

from mlx_pinned.testing import tiny_vlm_path


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return tiny_vlm_path()
