from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned.server import cli


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Capture uvicorn.run instead of serving."""
    import uvicorn

    calls: list[dict[str, Any]] = []

    def fake_run(app: Any, **kwargs: Any) -> None:
        calls.append({"app": app, **kwargs})

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setattr("signal.signal", lambda *args: None)
    return calls


class TestServe:
    def test_model_and_options(
        self, runs: list[dict[str, Any]], tiny_model_path: Path
    ) -> None:
        argv = ["serve", str(tiny_model_path), "--port", "0", "--max-pending", "3"]
        argv += ["--served-model-name", "tiny", "--max-tokens-limit", "50"]
        assert cli.main(argv) == 0
        (call,) = runs
        assert call["host"] == "127.0.0.1"
        assert call["port"] == 0
        config = call["app"].state.config
        assert config.served_model_name == "tiny"
        assert config.max_tokens_limit == 50
        assert config.max_pending == 3
        assert config.api_key is None

    def test_demo_serves_the_tiny_model(
        self, runs: list[dict[str, Any]], tiny_model_path: Path
    ) -> None:
        assert cli.main(["serve", "--demo"]) == 0
        config = runs[0]["app"].state.config
        assert config.served_model_name == cli.DEMO_MODEL_NAME
        assert Path(config.model) == tiny_model_path

    def test_api_key_from_environment(
        self, runs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(cli.API_KEY_ENV, "k")
        assert cli.main(["serve", "--demo"]) == 0
        assert runs[0]["app"].state.config.api_key == "k"

    def test_warns_when_exposed_without_key(
        self, runs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, "mlx_pinned.server")
        cli.main(["serve", "--demo", "--host", "127.0.0.2"])
        assert "without an API key" not in caplog.text
        cli.main(["serve", "--demo", "--host", "0.0.0.0"])
        assert "without an API key" in caplog.text


class TestArguments:
    @pytest.mark.parametrize(
        "argv",
        [
            [],
            ["serve"],
            ["serve", "model", "--demo"],
            ["serve", "model", "--max-pending", "0"],
            ["serve", "model", "--port", "x"],
        ],
    )
    def test_usage_errors_exit_2(self, argv: list[str]) -> None:
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
