"""``mlx-pinned serve --config FILE``: models with settings of their own, the
server's settings, what a flag overrides, and a clear error for each
mistake; then a server with one model loaded at start-up and one on first
use, through HTTP."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_pinned.server import ServerConfig, cli, create_app
from mlx_pinned.server.config_file import read_config_file
from mlx_pinned.server.engine.memory import stored_weight_bytes
from mlx_pinned.testing import make_tiny_vlm

from .conftest import assert_error
from .kit import Lifespan
from .openapi import CheckedTransport

EXAMPLE = """
    max_model_bytes = 8_000_000_000
    idle_unload_timeout = 600
    max_images = 3
    allowed_origins = ["https://app.example", "http://localhost:3000"]

    [[models]]
    path = "org/small"
    name = "small"
    max_num_seqs = 8

    [[models]]
    path = "org/large"
    load_on_first_use = true
    idle_unload_timeout = 0
"""


def write(tmp_path: Path, text: str, name: str = "models.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


class TestReading:
    def test_models_their_settings_and_the_servers(self, tmp_path: Path) -> None:
        read = read_config_file(write(tmp_path, EXAMPLE))
        assert read.models == ("org/small", "org/large")
        assert read.names == ("small", "org/large")  # a model without a name
        assert read.settings == {
            "max_model_bytes": 8_000_000_000,
            "idle_unload_timeout": 600.0,
            "image_limits.max_images": 3,
            "allowed_origins": ("https://app.example", "http://localhost:3000"),
        }
        # As the flags read them: 0 seconds is never, as --idle-unload-timeout 0.
        assert read.model_settings == (
            {"max_num_seqs": 8},
            {"load_on_first_use": True, "idle_unload_timeout": None},
        )

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("max_num_seqs = [", "not TOML"),
            ("max_num_seqs = 4", "give the models as [[models]] tables"),
            ("[[models]]\nname = 'x'", "models[0] needs a path"),
            ("model = 'x'\n[[models]]\npath = 'a/b'", "model goes in each"),
            ("max_num_sequences = 4\n[[models]]\npath = 'a/b'", "max_num_sequences"),
            ("[[models]]\npath = 'a/b'\napi_key = 'k'", "models[0].api_key: a model"),
            ("[[models]]\npath = 'a/b'\nmax_num_seqs = 'x'", "must be a whole number"),
            ("load_on_first_use = 1\n[[models]]\npath = 'a/b'", "is true or false"),
            ("max_pending = true\n[[models]]\npath = 'a/b'", "not a value of"),
        ],
    )
    def test_each_mistake_is_named(
        self, tmp_path: Path, text: str, message: str
    ) -> None:
        with pytest.raises(ValueError, match=r"models\.toml: ") as info:
            read_config_file(write(tmp_path, text))
        assert message in str(info.value)


class TestCommandLine:
    def config(self, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> ServerConfig:
        """The config ``serve`` would start with (uvicorn never runs)."""
        seen: list[ServerConfig] = []

        def serve(args: argparse.Namespace, config: ServerConfig) -> int:
            seen.append(config)
            return 0

        monkeypatch.setattr(cli, "serve", serve)
        assert cli.main(["serve", *argv]) == 0
        (config,) = seen
        return config

    def test_the_file_gives_the_models_and_settings(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        config = self.config(monkeypatch, ["--config", str(write(tmp_path, EXAMPLE))])
        assert config.names == ("small", "org/large")
        assert config.max_model_bytes == 8_000_000_000
        assert config.image_limits.max_images == 3
        small, large = config.for_model(0), config.for_model(1)
        assert (small.max_num_seqs, large.max_num_seqs) == (8, config.max_num_seqs)
        assert not small.load_on_first_use
        assert large.load_on_first_use
        # The server's idle timeout is for models loaded on first use; the
        # large model's own 0 is never.
        assert (small.idle_unload_timeout, large.idle_unload_timeout) == (None, None)
        assert config.thread_bound == (
            small.max_pending + 8 + large.max_pending + large.max_num_seqs
        )

    def test_a_flag_given_overrides_the_files_setting(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = str(write(tmp_path, EXAMPLE))
        argv = ["--config", path, "--max-model-b", "1000", "--max-num-seqs", "2"]
        config = self.config(monkeypatch, argv)  # an abbreviated flag counts too
        assert config.max_model_bytes == 1000
        assert config.image_limits.max_images == 3  # not given: the file's
        # A model's own setting is more specific than the server-wide flag.
        assert config.for_model(0).max_num_seqs == 8
        assert config.for_model(1).max_num_seqs == 2

    def test_the_config_checks_the_file_with_the_flags_on_top(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Eager models may not idle out: the flag makes them lazy, and the one
        # check runs on what the server will use.
        path = write(tmp_path, "idle_unload_timeout = 5\n[[models]]\npath = 'org/m'\n")
        config = self.config(
            monkeypatch, ["--config", str(path), "--load-on-first-use"]
        )
        assert (config.idle_unload_timeout, config.load_on_first_use) == (5.0, True)

    @pytest.mark.parametrize(
        ("extra", "message"),
        [
            (["org/other"], "give no MODEL"),
            (["--served-model-name", "x"], "give no MODEL"),
            (["--demo"], "give no MODEL"),
        ],
    )
    def test_models_come_from_the_file_alone(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        extra: list[str],
        message: str,
    ) -> None:
        path = str(write(tmp_path, EXAMPLE))
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "--config", path, *extra])
        assert info.value.code == 2
        assert message in capsys.readouterr().err

    def test_a_bad_file_is_a_usage_error_naming_it(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        eager = "idle_unload_timeout = 5\n[[models]]\npath = 'org/m'\n"
        none = "[[models]]\npath = 'org/m'\nmax_num_seqs = 0\n"
        missing = "[[models]]\npath = '/nowhere/m'\n"
        for path, text in (
            (
                str(write(tmp_path, missing, "d.toml")),
                f"--config {tmp_path / 'd.toml'}: path: no model folder at "
                "'/nowhere/m'",
            ),
            (str(tmp_path / "missing.toml"), "missing.toml"),
            (str(write(tmp_path, "[[models]]\nname = 'x'", "a.toml")), "needs a path"),
            (
                str(write(tmp_path, eager, "b.toml")),
                "b.toml: idle_unload_timeout needs load_on_first_use",
            ),
            # The config's check, named as the file says it.
            (
                str(write(tmp_path, none, "c.toml")),
                "--config " + str(tmp_path / "c.toml") + ": model 'org/m': "
                "max_num_seqs must be >= 1, not 0",
            ),
        ):
            with pytest.raises(SystemExit) as info:
                cli.main(["serve", "--config", path])
            assert info.value.code == 2
            assert text in capsys.readouterr().err


@pytest.fixture(scope="session")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("config-file") / "seed-1", seed=1)


class TestMixed:
    @asynccontextmanager
    async def serve(
        self, lifespan: Lifespan, paths: tuple[Path, Path], **options: Any
    ) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
        app = create_app(
            paths,
            served_model_name=("eager", "lazy"),
            model_settings=({"max_num_seqs": 3}, {"load_on_first_use": True}),
            **options,
        )
        transport = CheckedTransport(httpx.ASGITransport(app=app))
        async with (
            lifespan(app),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            yield app, client

    @pytest.mark.anyio
    async def test_one_at_start_up_one_on_first_use(
        self, lifespan: Lifespan, tiny_model_path: Path, other: Path
    ) -> None:
        paths = (tiny_model_path, other)
        async with self.serve(lifespan, paths, idle_unload_timeout=60) as (app, client):
            health = await client.get("/health")  # ready: the eager one is loaded
            assert health.status_code == 200
            assert {k: v["loaded"] for k, v in health.json()["models"].items()} == {
                "eager": True,
                "lazy": False,
            }
            eager, lazy = app.state.models.get("eager"), app.state.models.get("lazy")
            assert eager.slot.at_start_up
            assert not lazy.slot.at_start_up
            assert lazy.slot.idle_timeout == 60
            assert (eager.gate.max_num_seqs, lazy.gate.max_num_seqs) == (3, 32)
            body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
            for name in ("eager", "lazy"):
                answer = await client.post(
                    "/v1/chat/completions", json={**body, "model": name}
                )
                assert answer.status_code == 200, answer.text
            assert lazy.slot.loads == 1

    @pytest.mark.anyio
    async def test_the_budget_counts_the_model_loaded_at_start_up(
        self, lifespan: Lifespan, tiny_model_path: Path, other: Path
    ) -> None:
        budget = stored_weight_bytes(tiny_model_path) + 1000
        paths = (tiny_model_path, other)
        async with self.serve(lifespan, paths, max_model_bytes=budget) as (_, client):
            refused = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "lazy",
                    "messages": [{"role": "user", "content": "Hi."}],
                    "max_tokens": 2,
                },
            )
            error = assert_error(refused, 503, None, "model_memory_budget")
            assert "never fits" in error["message"]
            assert "loaded at start-up or pinned hold" in error["message"]
