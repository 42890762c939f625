"""``mlx-pinned serve``: run the vision server under uvicorn.

::

    mlx-pinned serve MODEL [MODEL ...] [--host 127.0.0.1] [--port 8000]
                           [--served-model-name NAME ...] [--max-tokens-limit N]
                           [--max-pending N] [--max-num-seqs N] [--api-key KEY]
                           [--request-timeout S] [--max-prompt-tokens N]
                           [--allow-remote-images] [--max-images N] ...
    mlx-pinned serve --demo        # the tiny offline model of mlx_pinned.testing
    mlx.launch ... -- -m mlx_pinned.server serve MODEL --distributed tensor

``MODEL`` is a local model folder or a Hugging Face hub id; several are
served together, each under its own name (``--served-model-name`` given once
per MODEL, in the same order, or not at all). ``--demo`` writes the tiny
random-weight model to the cache folder (``$MLX_PINNED_CACHE``, else
``~/.cache/mlx-pinned``) and serves it as ``mlx-pinned-demo``: it works
offline, and answers with random text. Every limit: docs/security.md.
With ``--distributed tensor`` every rank of an ``mx.distributed`` group runs
the same command: rank 0 serves, the others bind no port and follow it
(docs/distributed.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import ipaddress
import logging
import logging.handlers
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from queue import SimpleQueue
from types import FrameType
from typing import Any

from .config import (
    API_KEY_ENV,
    ImageLimits,
    ServerConfig,
    Setting,
    command_line_settings,
    whole,
)
from .config_file import ConfigFile, read_config_file

__all__ = ["main"]

DEMO_MODEL_NAME = "mlx-pinned-demo"
KEEP_ALIVE_SECONDS = 75  # an idle connection is kept this long
STARTUP_FAILURE = 3  # the exit status of a failed model load, as uvicorn's

logger = logging.getLogger("mlx_pinned.server")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mlx-pinned`` command."""
    parser = argparse.ArgumentParser(
        prog="mlx-pinned",
        description="One pinned MLX thread for async servers.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a vision model with an OpenAI-compatible API",
        description="Serve a vision-language model with an OpenAI-compatible "
        "chat-completions API (POST /v1/chat/completions).",
    )
    serve.add_argument(
        "model",
        nargs="*",
        metavar="MODEL",
        help="a local model folder or a Hugging Face hub id; several are served "
        "together, each under its own name",
    )
    serve.add_argument(
        "--demo",
        action="store_true",
        help="serve the tiny random-weight test model (offline; random text)",
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of the models (each with its own settings, if any) "
        "and the server's settings, instead of MODEL; flags given too override "
        "its settings (docs/server.md)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    serve.add_argument(
        "--port",
        type=_port,
        default=8000,
        help="default: %(default)s; 0: any free port",
    )
    for setting in command_line_settings():
        _add_setting(serve, setting)
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="also log uvicorn's line for every request (off: the server logs "
        "one line per chat request, with the client address, and nothing for "
        "/health)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="default: %(default)s",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mlx-pinned`` command; returns the exit status.

    Blocks until the server stops (SIGINT or SIGTERM: ``/health`` answers
    503 for ``--drain-seconds`` while the server goes on serving, then the
    listener closes, in-flight requests get ``--drain-timeout`` seconds to
    finish, and the MLX thread shuts down).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config_file = None
    if args.config is not None:
        if args.model or args.demo or args.served_model_name:
            parser.error(
                "--config names the models: give no MODEL, --demo or "
                "--served-model-name with it"
            )
        try:
            args.config_file = read_config_file(args.config)
        except (OSError, ValueError) as exc:
            parser.error(f"--config: {exc}")
        args.given = _given(argv)
        args.model = list(args.config_file.models)
        args.served_model_name = list(args.config_file.names)
    elif args.demo == bool(args.model):
        parser.error("serve needs a MODEL, or --demo (not both)")
    names = args.served_model_name
    models = len(args.model) or 1  # --demo serves one
    if names is not None and len(names) != models:
        parser.error(
            "give --served-model-name once per MODEL, in the same order "
            f"({_count(models, 'MODEL')}, {_count(len(names), 'name')})"
        )
    if args.distributed is not None and models > 1:
        parser.error("--distributed serves one MODEL")
    served = names or args.model
    taken = [name for name in served if served.count(name) > 1]
    if taken:
        parser.error(
            f"two models are served as {taken[0]!r}: give each its own "
            "--served-model-name"
        )
    if args.api_key == "":  # e.g. a blank MLX_PINNED_API_KEY= line
        parser.error(
            f"the API key (--api-key or ${API_KEY_ENV}) is empty: give a key, or "
            "unset it"
        )
    try:  # the settings that depend on each other (the demo's model aside)
        _config(args, args.model or [DEMO_MODEL_NAME], args.served_model_name)
    except ValueError as exc:
        parser.error(str(exc))
    for model in args.model:
        if _looks_local(model) and not Path(model).is_dir():
            parser.error(
                f"no model folder at {model!r} (a path; a Hugging Face hub id "
                "looks like 'org/name')"
            )
    with log_from_a_thread(args.log_level.upper()):
        return serve(args)


@contextlib.contextmanager
def log_from_a_thread(level: str) -> Iterator[None]:
    """Set up logging (if nothing has) so that records are written to stderr
    by a thread of their own: the event loop only queues them. A write to
    stderr is a system call on the loop, once per request, and
    a full pipe (a log collector that lags) would block the loop until it
    drains. What is queued is written before this returns, and the handler
    is taken off again (a second run in the process logs as the first)."""
    queue: SimpleQueue[logging.LogRecord] = SimpleQueue()
    out = logging.StreamHandler()
    out.setFormatter(logging.Formatter(LOG_FORMAT))
    listener = logging.handlers.QueueListener(queue, out)
    queued = logging.handlers.QueueHandler(queue)
    # The message only (else basicConfig gives it its own format): the
    # listener's handler formats the line.
    queued.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=level, handlers=[queued])
    listener.start()
    try:
        yield
    finally:
        listener.stop()
        logging.getLogger().removeHandler(queued)  # if basicConfig put it there


def serve(args: argparse.Namespace) -> int:
    """Load the models and serve them until interrupted."""
    import uvicorn

    from .app import create_app
    from .http.uvicorn_server import Server

    models = list(args.model)
    names = args.served_model_name
    if args.demo:
        from mlx_pinned.testing import tiny_vlm_path

        logger.info("writing the demo model (offline)")
        try:
            models = [str(tiny_vlm_path())]
        except OSError as exc:
            logger.error(
                "could not write the demo model: %s; set MLX_PINNED_CACHE to a "
                "writable folder",
                exc,
            )
            return 1
        names = names or [DEMO_MODEL_NAME]
    if not _is_loopback(args.host) and not args.api_key:
        logger.warning(
            "listening on %s without an API key: anyone who can reach it can use "
            "the model; pass --api-key or set %s",
            args.host,
            API_KEY_ENV,
        )
    config = _config(args, models, names)
    leader = None
    if config.distributed is not None:
        from .engine import distributed

        try:
            group = distributed.join(config)
        except distributed.DistributedError as exc:
            logger.error("%s", exc)
            return distributed.SETUP_STATUS
        if group.rank() != 0:  # a follower: no port, no app
            return int(distributed.Follower(group, config).run())
        leader = distributed.Leader(group, config.distributed_timeout)
    app = create_app(config=config, engine_factory=leader.load if leader else None)
    logger.info(
        "serving %s (event loop: %s, HTTP parser: %s)",
        ", ".join(
            f"{own.model} as {own.name!r}"
            + (" (loaded on first use)" if own.load_on_first_use else "")
            for own in map(config.for_model, range(len(config.models)))
        ),
        "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "httptools" if importlib.util.find_spec("httptools") else "h11",
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal
    # to the handler it found: with this one, a clean shutdown exits 0.
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        log_config=None,  # keep the logging set up in main()
        # Past the drain: uvicorn's own limit must not cut it short.
        timeout_graceful_shutdown=math.ceil(config.drain_timeout) + 5,
        # Longer than clients keep idle connections (httpx, and so the openai
        # package: 5 s; nginx upstream: 60 s), so the client always closes
        # first: otherwise a request sent on a connection the server is
        # closing fails.
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    # The socket first, the model after: a port in use fails at once, not
    # after the load with the load's exit status (a restart loop would reload
    # each time); the server answers probes while the model loads.
    try:
        sockets = _listen(args.host, args.port, uvicorn_config.backlog)
    except OSError as exc:
        logger.error("cannot listen on %s port %d: %s", args.host, args.port, exc)
        return 1
    server = Server(
        uvicorn_config,
        readiness=app.state.readiness,
        drain_seconds=config.drain_seconds,
    )
    previous = {s: signal.signal(s, _stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=sockets)
    finally:  # Ctrl-C works again in a process that goes on (tests, embedding)
        for sock in sockets:
            sock.close()
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        if leader is not None:  # the followers exit once rank 0 is done
            leader.stop()
    if server.load_failed:
        return STARTUP_FAILURE
    if leader is not None and leader.fault_reason is not None:
        return distributed.FAULT_STATUS
    return 0


def _listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address of ``host``, as asyncio makes them
    for uvicorn (IPv6 ones IPv6-only). Listening, not only bound: a second
    server bound to the same port is refused at once, and connections queue
    while the model loads."""
    infos = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _stopped(signum: int, frame: FrameType | None) -> None:
    logger.info("stopped by %s", signal.Signals(signum).name)


def _port(text: str) -> int:
    value = _argument(whole)(text)
    if not 0 <= value <= 65535:  # uvloop took 70000 as 70000 - 65536
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, not {value}")
    return int(value)


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError becomes the usage error's text."""

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = parse.__name__  # argparse names it in some messages
    return read


def _add_setting(parser: argparse.ArgumentParser, setting: Setting) -> None:
    """A flag for one setting of :class:`ServerConfig`."""
    dest = "_".join(setting.path)
    default = setting.default
    if setting.env is not None:
        default = os.environ.get(setting.env, default)
    if setting.repeated:  # once per model: a list, in order
        parser.add_argument(
            setting.flag,
            dest=dest,
            type=_argument(setting.parse or str),
            action="append",
            default=default,
            help=setting.help,
        )
        return
    if setting.parse is None:  # a switch: --x, and --no-x where it is on
        action = argparse.BooleanOptionalAction if default else "store_true"
        parser.add_argument(
            setting.flag, dest=dest, action=action, default=default, help=setting.help
        )
        return
    parser.add_argument(
        setting.flag,
        dest=dest,
        type=_argument(setting.parse),
        default=default,
        help=setting.help,
    )


def _config(
    args: argparse.Namespace, models: Sequence[str], names: Sequence[str] | None
) -> ServerConfig:
    """The :class:`ServerConfig` of the parsed flags, for ``models`` served as
    ``names`` (None: as given)."""
    values: dict[str, Any] = {"model": tuple(models)}
    limits: dict[str, Any] = {}
    for setting in command_line_settings():
        value = getattr(args, "_".join(setting.path))
        if len(setting.path) == 2:
            limits[setting.path[1]] = value
        else:
            values[setting.path[0]] = value
    values["served_model_name"] = None if names is None else tuple(names)
    file: ConfigFile | None = getattr(args, "config_file", None)
    if file is not None:
        # The file's settings, unless a flag given on the command line says.
        given: set[str] = getattr(args, "given", set())
        for dest, value in file.settings.items():
            if dest in given:
                continue
            if dest.startswith("image_limits_"):
                limits[dest[len("image_limits_") :]] = value
            else:
                values[dest] = value
        values["model_settings"] = file.model_settings
    return ServerConfig(**values, image_limits=ImageLimits(**limits))


def _given(argv: Sequence[str] | None) -> set[str]:
    """The settings whose flags ``argv`` gives (abbreviated ones included):
    parsed again with no defaults, so only those given are set."""
    parser = build_parser()
    (commands,) = (
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    dests = {"_".join(setting.path) for setting in command_line_settings()}
    for action in commands.choices["serve"]._actions:
        if action.dest in dests:
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) & dests


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def _looks_local(model: str) -> bool:
    """Whether MODEL is written as a path: a hub id is 'name' or 'org/name'."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
