"""``mlx-pinned serve``: run the server under uvicorn (docs/server.md).

``MODEL`` is a model folder or a Hugging Face hub id; ``--demo`` serves the
tiny offline models of :mod:`mlx_pinned.testing`, one of each kind; with
``--distributed tensor`` rank 0 serves and the other ranks follow it. Runs
on the main thread, which uvicorn's event loop then takes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import ipaddress
import logging
import logging.handlers
import math
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from queue import SimpleQueue
from types import FrameType
from typing import Any, NoReturn

from .cli_options import API_KEY_ENV, OPTIONS, add_options, whole
from .config import ImageLimits, ServerConfig, SettingError
from .config_checks import SAME
from .config_file import ConfigFile, read_config_file
from .kinds import KINDS, kind_named

__all__ = ["main"]

DEMO_MODEL_NAME = "mlx-pinned-demo"
KEEP_ALIVE_SECONDS = 75  # an idle connection is kept this long
STARTUP_FAILURE = 3  # the exit status of a failed model load, as uvicorn's

logger = logging.getLogger("mlx_pinned.server")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-pinned",
        description="One pinned MLX thread for async servers.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve models with an OpenAI-compatible API",
        description="Serve one or more models with an OpenAI-compatible API.",
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
        help="serve a tiny random-weight test model of each kind (offline; "
        "random answers)",
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
    add_options(serve)
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
    """Run the ``mlx-pinned`` command; returns the exit status. Blocks until
    the server stops (SIGINT or SIGTERM, in the phases of
    ``--unready-seconds`` and ``--in-flight-timeout``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    file = None
    if args.config is not None:
        if args.model or args.demo or "served_model_name" in args:
            parser.error(
                "--config names the models: give no MODEL, --demo or "
                "--served-model-name with it"
            )
        try:
            file = read_config_file(args.config)
        except (OSError, ValueError) as exc:
            _refuse(parser, f"--config: {exc}")
    elif args.demo == bool(args.model):
        parser.error("serve needs a MODEL, or --demo (not both)")
    try:
        config = _config(args, file)
    except SettingError as exc:
        _refuse(parser, _refused(exc, args, file))
    named = ("MODEL", "--draft-model") if file is None else ("path", "draft_model")
    at = "" if file is None else f"--config {args.config}: "
    for index in () if args.demo else range(len(config.models)):
        own = config.for_model(index)
        paths = (own.path, own.draft_model)
        for setting, path in zip(named, paths, strict=True):
            if path is not None and _looks_local(path) and not Path(path).is_dir():
                _refuse(
                    parser,
                    f"{at}{setting}: no model folder at {path!r} (a path; a Hugging "
                    "Face hub id looks like 'org/name')",
                )
    if config.state_dir is not None and (why := _unwritable(Path(config.state_dir))):
        error = SettingError("state_dir", f"state_dir {config.state_dir!r} {why}")
        _refuse(parser, _refused(error, args, file))
    with log_from_a_thread(args.log_level.upper()):
        try:
            return serve(args, config)
        except SettingError as exc:  # one that is checked as the app opens it
            _refuse(parser, _refused(exc, args, file))


@contextlib.contextmanager
def log_from_a_thread(level: str) -> Iterator[None]:
    """Set up logging (if nothing has) so that records are written to stderr
    by a thread of their own: the event loop only queues them, and a full
    pipe cannot block it. What is queued is written before this returns,
    and the handler is taken off again."""
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


def serve(args: argparse.Namespace, config: ServerConfig) -> int:
    import uvicorn

    from .app import create_app
    from .http.uvicorn_server import LAST_WRITES, Server

    if args.demo:
        logger.info("writing the demo models (offline)")
        try:
            config = _demo(config)
        except OSError as exc:
            logger.error(
                "could not write the demo model: %s; set MLX_PINNED_CACHE to a "
                "writable folder",
                exc,
            )
            return 1
    if not _is_loopback(args.host) and not config.api_key:
        logger.warning(
            "listening on %s without an API key: anyone who can reach it can use "
            "the model; pass --api-key or set %s",
            args.host,
            API_KEY_ENV,
        )
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
            f"{own.path} as {own.name!r}"
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
        # Past the drain and its last writes: uvicorn's own limit cancels
        # what runs then, with a traceback each.
        timeout_graceful_shutdown=math.ceil(config.in_flight_timeout + LAST_WRITES) + 2,
        # Longer than clients keep idle connections, so the client closes
        # first: a request sent on a connection the server closes fails.
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    # The socket first: a port in use fails at once, not after the load,
    # and probes are answered while the model loads.
    try:
        sockets = _listen(args.host, args.port, uvicorn_config.backlog)
    except OSError as exc:
        logger.error("cannot listen on %s port %d: %s", args.host, args.port, exc)
        return 1
    server = Server(
        uvicorn_config,
        readiness=app.state.readiness,
        unready_seconds=config.unready_seconds,
        outbox=app.state.outbox,
        in_flight_timeout=config.in_flight_timeout,
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
    for uvicorn (IPv6 ones IPv6-only), so connections queue while the model
    loads."""
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
    try:
        value = whole(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 <= value <= 65535:  # uvloop took 70000 as 70000 - 65536
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, not {value}")
    return int(value)


def demo_name(kind: str) -> str:
    return DEMO_MODEL_NAME if kind == "chat" else f"{DEMO_MODEL_NAME}-{kind}"


def _demo(config: ServerConfig) -> ServerConfig:
    """``config`` serving each kind's demo model (written first if it is not
    in the cache); the chat model alone under ``--distributed``.

    Raises:
        OSError: A model could not be written.
    """
    kinds = [kind for kind in KINDS.values() if kind.demo is not None]
    if config.distributed is not None:
        kinds = [kind_named("chat")]
    names = [config.name if k.name == "chat" else demo_name(k.name) for k in kinds]
    return dataclasses.replace(
        config,
        model=tuple(str(kind.demo()) for kind in kinds if kind.demo is not None),
        served_model_name=tuple(names),
        model_settings=tuple({"model_kind": kind.name} for kind in kinds),
    )


def _config(args: argparse.Namespace, file: ConfigFile | None = None) -> ServerConfig:
    """The :class:`ServerConfig` of the flags over the command line's own
    defaults and a config file's settings: a flag given wins."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        own, env = option.declared.cli, option.declared.env
        if own is not SAME:  # the command line's own default
            values[option.setting] = own
        if env is not None and env in os.environ:
            values[option.setting] = os.environ[env]
    if file is not None:
        values.update(file.settings)
        values.update(served_model_name=file.names, model_settings=file.model_settings)
        models = list(file.models)
    else:
        models = args.model or [DEMO_MODEL_NAME]
    values.update(
        (o.setting, vars(args)[o.setting]) for o in OPTIONS if o.setting in args
    )
    prefix = "image_limits."
    limits = {
        key[len(prefix) :]: values.pop(key)
        for key in list(values)
        if key.startswith(prefix)
    }
    try:
        image_limits = ImageLimits(**limits)
    except SettingError as exc:
        raise SettingError(prefix + exc.setting, str(exc)) from None
    return ServerConfig(model=tuple(models), image_limits=image_limits, **values)


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit 2 with one line that names the setting (no usage text)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _refused(
    error: SettingError, args: argparse.Namespace, file: ConfigFile | None
) -> str:
    """The usage error for a setting the config refused, in the words it
    was given in: the config file's keys, the flags or the environment."""
    text = str(error)
    from_file = ("served_model_name", "model_settings", *file.settings) if file else ()
    if error.setting in from_file and error.setting not in args:
        return f"--config {args.config}: {text}"
    words = {o.setting.rpartition(".")[2]: o.flag for o in OPTIONS}
    for option in OPTIONS:
        env = option.declared.env
        if env is not None and env in os.environ and option.setting not in args:
            words[option.setting] = f"${env}"
    # A name in quotes is a value (a served name): as given.
    names = r"'[^']*'|\"[^\"]*\"|\b[a-z][a-z_]*\b"
    return re.sub(names, lambda word: words.get(word[0], word[0]), text)


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be made or written, in a few words (None: it
    can); what is missing of it is made later."""
    there = folder
    while not there.exists() and there != there.parent:
        there = there.parent
    where = "" if there == folder else f"cannot be made: {str(there)!r} "
    if not there.is_dir():
        return f"{where}is a file, not a folder"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{where}is read-only"
    return None


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
