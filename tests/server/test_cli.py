from __future__ import annotations

import dataclasses
import logging
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned.server import cli
from mlx_pinned.server.cli_options import NOT_ON_THE_COMMAND_LINE, OPTIONS
from mlx_pinned.server.config import ImageLimits, ServerConfig
from mlx_pinned.server.formats import REASONING_FORMATS, TOOL_CALL_FORMATS
from mlx_pinned.testing import (
    make_tiny_vlm,
    tiny_embedding_path,
    tiny_reranker_path,
    tiny_speech_path,
    tiny_transcription_path,
)

from .kit import read_only


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch) -> dict[int, Any]:
    """The signal handlers serve() installs, captured instead of installed
    (the ones before: two markers)."""
    installed: dict[int, Any] = {signal.SIGINT: "int", signal.SIGTERM: "term"}

    def fake_signal(signum: int, handler: Any) -> Any:
        previous, installed[signum] = installed.get(signum), handler
        return previous

    monkeypatch.setattr("signal.signal", fake_signal)
    return installed


@pytest.fixture
def runs(
    monkeypatch: pytest.MonkeyPatch, handlers: dict[int, Any]
) -> list[dict[str, Any]]:
    """Capture uvicorn's Server.run instead of serving."""
    import uvicorn

    calls: list[dict[str, Any]] = []

    def fake_run(server: uvicorn.Server, sockets: Any = None) -> None:
        config = server.config
        server.started = True
        calls.append(
            {
                "app": config.app,
                "handlers": dict(handlers),
                "sockets": sockets,
                "bound": [sock.getsockname() for sock in sockets or ()],
                "host": config.host,
                "port": config.port,
                "access_log": config.access_log,
                "timeout_graceful_shutdown": config.timeout_graceful_shutdown,
                "timeout_keep_alive": config.timeout_keep_alive,
            }
        )

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    # The default port may be taken on the machine running the tests; an
    # explicit --port (the port-in-use test) is bound as asked.
    listen = cli._listen
    default = cli.build_parser().parse_args(["serve", "--demo"]).port
    monkeypatch.setattr(
        cli,
        "_listen",
        lambda host, port, backlog: listen(
            host, 0 if port == default else port, backlog
        ),
    )
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

    def test_several_models_each_under_its_name(
        self, runs: list[dict[str, Any]], tiny_model_path: Path, tmp_path: Path
    ) -> None:
        other = make_tiny_vlm(tmp_path / "other", seed=1)
        argv = ["serve", str(tiny_model_path), str(other), "--max-num-seqs", "2"]
        argv += ["--served-model-name", "a", "--served-model-name", "b"]
        assert cli.main(argv) == 0
        app = runs[0]["app"]
        config = app.state.config
        assert config.models == (str(tiny_model_path), str(other))
        assert config.names == ("a", "b")
        assert config.max_num_seqs == 2  # every setting applies to each model
        assert app.state.models.names == ["a", "b"]

    def test_a_config_file_serves_its_models_with_their_settings(
        self,
        runs: list[dict[str, Any]],
        tiny_model_path: Path,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.INFO, logger="mlx_pinned.server")
        file = tmp_path / "models.toml"
        file.write_text(
            f"max_num_seqs = 4\n[[models]]\npath = '{tiny_model_path}'\nname = 'a'\n"
            f"[[models]]\npath = '{tiny_model_path}'\nname = 'b'\n"
            "load_on_first_use = true\n"
        )
        assert cli.main(["serve", "--config", str(file)]) == 0
        models = runs[0]["app"].state.models
        assert models.names == ["a", "b"]
        assert models.get("a").slot.at_start_up
        assert not models.get("b").slot.at_start_up
        assert models.get("b").gate.max_num_seqs == 4  # the file's server setting
        assert "as 'b' (loaded on first use)" in caplog.text
        assert "as 'a' (loaded" not in caplog.text

    def test_output_formats_are_named_on_the_command_line(
        self, runs: list[dict[str, Any]], tiny_model_path: Path
    ) -> None:
        argv = ["serve", str(tiny_model_path), "--tool-call-parser", "none"]
        argv += ["--reasoning-parser", "think"]
        assert cli.main(argv) == 0
        config = runs[0]["app"].state.config
        assert (config.tool_call_parser, config.reasoning_parser) == ("none", "think")

    def test_several_models_without_names_are_served_as_given(
        self, runs: list[dict[str, Any]]
    ) -> None:
        assert cli.main(["serve", "org/one", "org/two"]) == 0
        assert runs[0]["app"].state.config.names == ("org/one", "org/two")

    def test_hardening_options(self, runs: list[dict[str, Any]]) -> None:
        argv = ["serve", "--demo", "--allow-remote-images", "--request-timeout", "5"]
        argv += ["--max-prompt-tokens", "100", "--max-images", "2"]
        argv += ["--max-image-bytes", "1000", "--max-image-pixels", "4096"]
        argv += ["--remote-image-timeout", "2.5"]
        assert cli.main(argv) == 0
        config = runs[0]["app"].state.config
        assert config.allow_remote_images
        assert config.remote_image_timeout == 2.5
        assert config.request_timeout == 5
        assert config.max_prompt_tokens == 100
        limits = config.image_limits
        assert (limits.max_images, limits.max_bytes, limits.max_pixels) == (
            2,
            1000,
            4096,
        )

    def test_hardening_defaults(self, runs: list[dict[str, Any]]) -> None:
        assert cli.main(["serve", "--demo", "--request-timeout", "0"]) == 0
        config = runs[0]["app"].state.config
        assert not config.allow_remote_images
        assert config.request_timeout is None
        assert config.max_prompt_tokens is None  # the model's context length

    def test_sigint_is_handled_as_sigterm(
        self, runs: list[dict[str, Any]], handlers: dict[int, Any]
    ) -> None:
        # test_e2e drains a stream under SIGTERM and sees exit 0; SIGINT takes
        # the same handler, so uvicorn drains and exits 0 the same way.
        assert cli.main(["serve", "--demo"]) == 0
        during = runs[0]["handlers"]
        assert during[signal.SIGINT] is during[signal.SIGTERM] is cli._stopped
        assert runs[0]["timeout_graceful_shutdown"] > 0
        # Given back after: Ctrl-C worked no more in a process that went on.
        assert handlers == {signal.SIGINT: "int", signal.SIGTERM: "term"}

    def test_a_port_in_use_fails_before_the_model_loads(
        self, runs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
    ) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            # uvicorn binds after the start-up: the model loaded first, then
            # the bind failed with exit 3, the status of a failed load.
            assert cli.main(["serve", "--demo", "--port", str(port)]) == 1
        assert runs == []  # never started: no lifespan, no model load
        assert f"cannot listen on 127.0.0.1 port {port}" in caplog.text

    def test_the_bound_socket_is_what_uvicorn_serves(
        self, runs: list[dict[str, Any]]
    ) -> None:
        assert cli.main(["serve", "--demo", "--port", "0"]) == 0
        (sock,) = runs[0]["sockets"]
        (address,) = runs[0]["bound"]
        assert address[0] == "127.0.0.1"
        assert address[1] > 0  # --port 0: a free one
        assert sock.fileno() == -1  # closed once the server is done

    def test_a_second_server_on_the_port_is_refused_while_the_first_loads(
        self,
    ) -> None:
        # Bound but not listening, both binds succeeded (SO_REUSEADDR): the
        # second server loaded its model, then died with a traceback.
        first = cli._listen("127.0.0.1", 0, 16)
        try:
            port = first[0].getsockname()[1]
            with pytest.raises(OSError, match="in use"):
                cli._listen("127.0.0.1", port, 16)
        finally:
            for sock in first:
                sock.close()

    def test_every_address_of_the_host_is_served_ipv6_only(self) -> None:
        # An address family from ":" in the host bound 'localhost' on IPv4
        # only, and made '::' dual-stack.
        sockets = cli._listen("localhost", 0, 16)
        try:
            expected = {
                i[0]
                for i in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)
            }
            assert {s.family for s in sockets} == expected
            for sock in sockets:
                if sock.family == socket.AF_INET6:
                    assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        finally:
            for sock in sockets:
                sock.close()

    def test_an_unwritable_demo_cache_is_one_clear_line(
        self,
        runs: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        monkeypatch.setenv("MLX_PINNED_CACHE", str(blocker))
        assert cli.main(["serve", "--demo"]) == 1  # was a FileExistsError traceback
        assert "could not write the demo model" in caplog.text
        assert "MLX_PINNED_CACHE" in caplog.text
        assert runs == []

    def test_access_log_is_off_unless_asked(self, runs: list[dict[str, Any]]) -> None:
        assert cli.main(["serve", "--demo"]) == 0
        assert cli.main(["serve", "--demo", "--access-log"]) == 0
        assert [call["access_log"] for call in runs] == [False, True]

    def test_demo_serves_the_tiny_model(
        self, runs: list[dict[str, Any]], tiny_model_path: Path
    ) -> None:
        assert cli.main(["serve", "--demo"]) == 0
        config = runs[0]["app"].state.config
        assert config.names == (
            cli.DEMO_MODEL_NAME,
            cli.demo_name("embedding"),
            cli.demo_name("rerank"),
            cli.demo_name("transcription"),
            cli.demo_name("speech"),
        )
        assert Path(config.models[0]) == tiny_model_path
        assert Path(config.models[1]) == tiny_embedding_path()
        assert Path(config.models[2]) == tiny_reranker_path()
        assert Path(config.models[3]) == tiny_transcription_path()
        assert Path(config.models[4]) == tiny_speech_path()
        kinds = [model.kind for model in runs[0]["app"].state.models]
        assert kinds == ["chat", "embedding", "rerank", "transcription", "speech"]

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


@pytest.mark.slow
def test_log_lines_are_written_by_their_own_thread() -> None:
    # In a fresh interpreter (pytest has set logging up in this one): the
    # caller only queues the record; a listener thread writes it, and what is
    # queued is written before the block exits.
    script = textwrap.dedent(
        """
        import logging, sys, threading
        from mlx_pinned.server import cli

        written = []
        write = sys.stderr.write
        def spy(text):
            written.append(threading.current_thread() is threading.main_thread())
            return write(text)
        sys.stderr.write = spy
        with cli.log_from_a_thread("INFO"):
            for n in range(50):
                logging.getLogger("mlx_pinned.server").info("line %d", n)
        print(len(written), any(written))
        # Taken off again: a second run logs too (its listener was stopped).
        assert logging.getLogger().handlers == []
        with cli.log_from_a_thread("INFO"):
            logging.getLogger("mlx_pinned.server").info("line %d", 50)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 51
    assert lines[0].endswith("INFO mlx_pinned.server: line 0")
    assert lines[-1].endswith("INFO mlx_pinned.server: line 50")
    count, on_main = done.stdout.split()
    assert int(count) >= 50
    assert on_main == "False"  # never written by the thread that logged


class TestRefusedAtStart:
    """A setting refused at start is one line that names it, no traceback,
    and a non-zero exit: 2 before the load, 3 when the load refuses it."""

    @staticmethod
    def serve(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "mlx_pinned.server", "serve", *argv]
        return subprocess.run(
            [*command, "--port", "0"], capture_output=True, text=True, timeout=120
        )

    def test_kv_bits_on_heads_no_group_divides(self, tiny_model_path: Path) -> None:
        done = self.serve(str(tiny_model_path), "--kv-bits", "8")
        assert done.returncode == cli.STARTUP_FAILURE
        log = done.stdout + done.stderr
        assert "Traceback" not in log
        (line,) = [line for line in log.splitlines() if "--kv-group-size" in line]
        assert "heads of 16 values" in line
        assert "serve it without --kv-bits" in line

    def test_a_config_key_of_the_wrong_type(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.toml"
        path.write_text("max_num_seqs = 'eight'\n[[models]]\npath = 'org/m'\n")
        done = self.serve("--config", str(path))
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            f"mlx-pinned: error: --config: {path}: max_num_seqs must be a whole "
            "number, not 'eight'"
        ]

    def test_a_missing_model_path(self, tmp_path: Path) -> None:
        missing = str(tmp_path / "nowhere")
        done = self.serve(missing)
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            f"mlx-pinned: error: MODEL: no model folder at {missing!r} (a path; a "
            "Hugging Face hub id looks like 'org/name')"
        ]

    def test_a_missing_draft_model_path(
        self, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", str(tiny_model_path), "--draft-model", "/nowhere/x"])
        assert info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            "mlx-pinned: error: --draft-model: no model folder at '/nowhere/x' (a "
            "path; a Hugging Face hub id looks like 'org/name')"
        ]

    def test_a_state_dir_that_is_a_file(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        file = tmp_path / "state"
        file.write_text("")
        for given, why in [
            (file, "is a file, not a folder"),
            (file / "sub", f"cannot be made: {str(file)!r} is a file, not a folder"),
        ]:
            with pytest.raises(SystemExit) as info:
                cli.main(["serve", "org/m", "--state-dir", str(given)])
            assert info.value.code == 2
            assert capsys.readouterr().err.splitlines() == [
                f"mlx-pinned: error: --state-dir {str(given)!r} {why}"
            ]

    def test_a_read_only_state_dir(self, tmp_path: Path) -> None:
        folder = tmp_path / "state"
        prefix = read_only(folder)
        for given, why in [
            (folder, "is read-only"),
            (folder / "a" / "b", f"cannot be made: {str(folder)!r} is read-only"),
        ]:
            command = [sys.executable, "-m", "mlx_pinned.server", "serve", "org/m"]
            command += ["--state-dir", str(given)]
            done = subprocess.run(
                [*prefix, *command], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 2
            assert done.stderr.splitlines() == [
                f"mlx-pinned: error: --state-dir {str(given)!r} {why}"
            ]


class TestArguments:
    @pytest.mark.parametrize(
        "argv",
        [
            [],
            ["serve"],
            ["serve", "model", "--demo"],
            ["serve", "model", "--max-pending", "0"],
            ["serve", "model", "--port", "x"],
            ["serve", "model", "--request-timeout", "-1"],
            ["serve", "model", "--request-timeout", "nan"],
            ["serve", "model", "--max-prompt-tokens", "0"],
            ["serve", "model", "--remote-image-timeout", "0"],
            # uvloop served --port 70000 on 70000 - 65536 = 4464
            ["serve", "model", "--port", "70000"],
            ["serve", "model", "--port", "-5"],
            ["serve", "--demo", "--api-key", ""],  # half a key: "Bearer " passed
            ["serve", "/nonexistent/model/dir"],  # an HFValidationError traceback
            ["serve", "./no-such-model"],
            # --served-model-name once per MODEL, or not at all
            ["serve", "a/b", "c/d", "--served-model-name", "x"],
            ["serve", "a/b", "--served-model-name", "x", "--served-model-name", "y"],
            ["serve", "--demo", "--served-model-name", "x", "--served-model-name", "y"],
            ["serve", "a/b", "a/b"],  # two models served as one name
            ["serve", "a/b", "--tool-call-parser", "xml"],
            ["serve", "a/b", "--reasoning-parser", "xml"],
            # two models, one name twice
            ["serve", "a/b", "c/d", *["--served-model-name", "x"] * 2],
        ],
    )
    def test_usage_errors_exit_2(self, argv: list[str]) -> None:
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2

    def test_usage_errors_say_what_is_wrong(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cases = [
            (
                ["serve", "m", "--max-pending", "abc"],
                "must be a whole number, not 'abc'",
            ),
            (["serve", "m", "--request-timeout", "x"], "must be a number of seconds"),
            (["serve", "m", "--port", "70000"], "must be 0 to 65535"),
            (["serve", "/nonexistent/model/dir"], "no model folder at"),
            (
                ["serve", "a/b", "c/d", "--served-model-name", "x"],
                "--served-model-name gives 1 names for 2 models: give one per "
                "model, in order",
            ),
            (
                ["serve", "a/b", "a/b"],
                "two models are served as 'a/b': give each its own --served-model-name",
            ),
            (  # a value in the message is as given, even a setting's name
                ["serve", "a/b", "c/d", *["--served-model-name", "max_pending"] * 2],
                "served as 'max_pending'",
            ),
            (
                ["serve", "m", "--tool-call-parser", "xml"],
                "--tool-call-parser 'xml' is not a format this server knows: give "
                f"one of {', '.join([*TOOL_CALL_FORMATS, 'none'])}",
            ),
            # Refused by the config, named by the flag that gave it.
            (["serve", "m", "--max-pending", "0"], "--max-pending must be >= 1"),
            (["serve", "m", "--max-images", "0"], "--max-images must be >= 1"),
            (["serve", "m", "--max-image-bytes", "0"], "--max-image-bytes must be"),
            (
                ["serve", "m", "--request-timeout", "-1"],
                "--request-timeout must be > 0, not -1.0",
            ),
            (
                ["serve", "m", "--allowed-origins", "a.example"],
                "--allowed-origins gives 'a.example': an origin is scheme://host",
            ),
            (["serve", "m", "--distributed", "pipe"], "--distributed must be"),
            (
                ["serve", "a/b", "c/d", "--distributed", "tensor"],
                "--distributed serves one model",
            ),
            (
                ["serve", "m", "--idle-unload-timeout", "5"],
                "--idle-unload-timeout needs --load-on-first-use",
            ),
            (
                ["serve", "m", "--reasoning-parser", "xml"],
                f"give one of {', '.join([*REASONING_FORMATS, 'none'])}",
            ),
        ]
        for argv, text in cases:
            with pytest.raises(SystemExit):
                cli.main(argv)
            err = capsys.readouterr().err
            assert text in err
            assert "_positive" not in err  # argparse's "invalid _positive value"
        monkeypatch.setenv(cli.API_KEY_ENV, "")  # a blank line in an env file
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "--demo"])
        assert info.value.code == 2
        assert f"${cli.API_KEY_ENV} is empty" in capsys.readouterr().err


class TestOneSettingsSource:
    """Every field of ServerConfig has a flag or is listed as having none,
    every flag is a field's (or the command's own), and the command line's
    defaults are the config's."""

    COMMAND_ONLY = frozenset(
        {
            *("--help", "--demo", "--config", "--host", "--port"),
            *("--access-log", "--log-level"),
        }
    )

    def test_every_field_has_an_option_or_is_off_the_command_line(self) -> None:
        fields = {f.name for f in dataclasses.fields(ServerConfig)}
        fields |= {f"image_limits.{f.name}" for f in dataclasses.fields(ImageLimits)}
        settings = [option.setting for option in OPTIONS]
        assert len(settings) == len(set(settings))
        assert not set(settings) & set(NOT_ON_THE_COMMAND_LINE)
        assert set(settings) | set(NOT_ON_THE_COMMAND_LINE) == fields
        flags = [option.flag for option in OPTIONS]
        assert len(flags) == len(set(flags))
        assert not set(flags) & self.COMMAND_ONLY

    def test_every_flag_of_serve_is_an_options_or_the_commands(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("COLUMNS", "1000")  # no flag cut at its dashes
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "--help"])
        out = capsys.readouterr().out
        shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", out))
        options = {option.flag for option in OPTIONS}
        negated = {"--no-freeze-gc", "--no-playground", "--no-mtp"}
        assert shown == options | self.COMMAND_ONLY | negated
        assert "SUPPRESS" not in out

    def test_no_playground_turns_the_page_off(self) -> None:
        args = cli.build_parser().parse_args(["serve", "m", "--no-playground"])
        assert cli._config(args).playground is False
        args = cli.build_parser().parse_args(["serve", "m"])
        assert cli._config(args).playground is True

    def test_the_namespace_holds_the_flags_given_only(self) -> None:
        args = cli.build_parser().parse_args(
            ["serve", "m", "--max-pend", "3", "--no-freeze-gc"]  # abbreviated too
        )
        given = [option.setting for option in OPTIONS if option.setting in args]
        assert given == ["max_pending", "freeze_gc"]

    def test_defaults_are_the_configs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
        args = cli.build_parser().parse_args(["serve", "m"])
        # The one default the command line sets itself (documented there).
        assert cli._config(args) == ServerConfig(model="m", freeze_gc=True)

    def test_the_help_shows_the_command_lines_defaults(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("COLUMNS", "1000")
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "--help"])
        out = capsys.readouterr().out
        assert "where the model's context is full (default: none)" in out
        assert "its API's error (stopping) (default: 30.0)" in out

    def test_a_new_value_reaches_the_config(self) -> None:
        argv = ["serve", "m", "--in-flight-timeout", "3", "--unready-seconds", "2"]
        argv += ["--retry-after", "4", "--no-freeze-gc", "--served-model-name", "name"]
        args = cli.build_parser().parse_args(argv)
        config = cli._config(args)
        assert (config.in_flight_timeout, config.unready_seconds) == (3.0, 2.0)
        assert config.retry_after == 4
        assert not config.freeze_gc
        assert config.name == "name"
