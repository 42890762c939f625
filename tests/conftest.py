from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# "ci" is deterministic so a red run can be replayed; "dev" and "nightly" explore.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: Any) -> str:
    backend: str = request.param
    return backend
