"""Every setting of the server, with its default, its check and its help.

One source: :class:`ServerConfig` declares each setting once, as a field
whose metadata holds its help text and how the command line spells and
parses it; ``create_app`` takes a config (or the same names as keywords) and
``mlx-pinned serve`` builds its flags from these fields
(:func:`command_line_settings`). A plain shared module: any thread.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .formats import (
    REASONING_FORMATS,
    TOOL_CALL_FORMATS,
    check_reasoning_parser,
    check_tool_call_parser,
)

__all__ = [
    "API_KEY_ENV",
    "PER_MODEL_SETTINGS",
    "ImageLimits",
    "ServerConfig",
    "Setting",
    "command_line_settings",
]

#: The environment variable that gives the command line's ``--api-key``.
API_KEY_ENV = "MLX_PINNED_API_KEY"

#: The settings a model may set for itself (:attr:`ServerConfig.model_settings`,
#: a config file's ``[[models]]`` entries); the others are the server's.
PER_MODEL_SETTINGS = frozenset(
    {
        "load_on_first_use",
        "idle_unload_timeout",
        "max_num_seqs",
        "max_pending",
        "prompt_cache_bytes",
        "image_cache_bytes",
        "prefill_step_size",
        "tool_call_parser",
        "reasoning_parser",
    }
)


def whole(text: str) -> int:
    """A whole number, from the command line."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a whole number, not {text!r}") from None


def positive(text: str) -> int:
    """A whole number of at least 1."""
    value = whole(text)
    if value < 1:
        raise ValueError(f"must be at least 1, not {value}")
    return value


def non_negative(text: str) -> int:
    """A whole number, 0 or more."""
    value = whole(text)
    if value < 0:
        raise ValueError(f"must be 0 or more, not {value}")
    return value


def origins(text: str) -> tuple[str, ...]:
    """Comma-separated origins (``https://app.example``), or ``*`` for any."""
    found = tuple(item.strip().rstrip("/") for item in text.split(",") if item.strip())
    if not found:
        raise ValueError("give at least one origin, e.g. https://app.example")
    for origin in found:
        if origin != "*" and "://" not in origin:
            raise ValueError(f"an origin is scheme://host[:port], not {origin!r}")
    return found


def seconds(text: str) -> float:
    """A number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number of seconds, not {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise ValueError(f"must be 0 or more, not {text}")
    return value


def positive_seconds(text: str) -> float:
    """A number of seconds, more than 0."""
    value = seconds(text)
    if value == 0:
        raise ValueError("must be more than 0")
    return value


def distribution(text: str) -> str:
    """How a model is split over the ranks of a group: ``tensor``."""
    if text != "tensor":
        raise ValueError(f"must be 'tensor', not {text!r}")
    return text


def seconds_or_none(text: str) -> float | None:
    """A number of seconds; 0 means no limit (None)."""
    return seconds(text) or None


def _setting(
    default: Any,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    flag: str | None = None,
    env: str | None = None,
    command_line_default: Any = dataclasses.MISSING,
    repeated: bool = False,
) -> Any:
    """A field of a settings class. ``help`` is its command-line help (with
    ``%(default)s``); ``parse`` reads its flag's text (None: a switch);
    ``flag`` overrides the flag's name; ``env``: the variable that gives the
    command line's default; ``command_line_default``: a default that the
    command line sets and the library does not (say why where it is used);
    ``repeated``: the flag is given once per model."""
    metadata = {
        "help": help,
        "parse": parse,
        "flag": flag,
        "env": env,
        "command_line_default": command_line_default,
        "repeated": repeated,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ImageLimits:
    """Limits on the images of one request.

    Attributes:
        max_images: Images per request, over all messages.
        max_bytes: Encoded (base64-decoded) bytes per image.
        max_pixels: Width times height per image, read from the header.
    """

    max_images: int = _setting(
        8, "images per request (default: %(default)s)", parse=positive
    )
    max_bytes: int = _setting(
        10 * 1024 * 1024,
        "encoded bytes per image (default: %(default)s)",
        parse=positive,
        flag="--max-image-bytes",
    )
    max_pixels: int = _setting(
        4096 * 4096,
        "width x height per image (default: %(default)s)",
        parse=positive,
        flag="--max-image-pixels",
    )

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            if getattr(self, item.name) < 1:
                raise ValueError(f"{item.name} must be >= 1")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server. Each is checked here; a bad one is a
    ``ValueError`` that names it. Every setting applies to each served
    model alike (``max_num_seqs`` rows and ``max_pending`` waiting requests
    per model).

    Attributes:
        model: A local model folder or a Hugging Face hub id; for several
            models, a sequence of them (kept as a tuple; a sequence of one is
            kept as its one string).
        served_model_name: The name clients send as ``model`` (None: ``model``
            as given; see :attr:`names`); for several models, a sequence of
            names in the order of ``model``, one per model. Any other name is
            a 404.
        max_tokens_limit: The largest ``max_tokens`` a request may ask for;
            more is a 400.
        default_max_tokens: ``max_tokens`` when a request sets none (at most
            ``max_tokens_limit``).
        max_pending: Requests that may wait for the model; past it, 503 with
            ``Retry-After``.
        max_num_seqs: Generations decoded together in one batch; the rest
            wait their turn.
        max_body_bytes: Largest request body; more is a 413.
        image_limits: Limits on images per request, bytes and pixels.
        api_key: When set, every route but ``/health`` needs
            ``Authorization: Bearer <api_key>``; otherwise 401.
        allowed_origins: Origins whose browser pages may call the API
            (CORS: preflights answered, ``Access-Control-Allow-Origin``
            sent); ``("*",)`` allows any. Empty: CORS off.
        allow_remote_images: Fetch ``http(s)://`` image URLs (off: they are a
            400), from public addresses only, at most
            ``image_limits.max_bytes`` per image.
        remote_image_timeout: Seconds for fetching one remote image.
        max_prompt_tokens: Most prompt tokens, images included; None: the
            model's context length from its config.
        request_timeout: Seconds a request may take after its body is read
            (images, queue wait and generation); past it, 504 (or an error
            event) and the generation is closed. None: no limit.
        load_wait: Seconds a request waits for its model's load (at start-up,
            or on first use) before a 503 ``model_not_loaded``; the
            readiness probe answers 503 meanwhile. None: as long as the load
            takes.
        drain_timeout: Seconds in-flight requests get at shut-down.
        drain_seconds: Seconds ``mlx-pinned serve`` keeps serving after
            SIGTERM with ``/health`` answering 503, before it closes its
            listener (then ``drain_timeout`` applies), so that balancers
            that probe ``/health`` stop sending first. A second signal ends
            the wait. Only the command line reads it: an app run under
            another server has no such wait.
        retry_after: Seconds sent in ``Retry-After`` with every 503 that
            asks the client to come back (a full waiting room, a busy thread).
        tool_call_parser: The format each model writes tool calls in, by
            name (``mlx_pinned.server.formats``), or ``"none"``: a request
            with tools is then a 400. None: the format its chat template
            shows, if any.
        reasoning_parser: The format each model writes its reasoning in, by
            name, or ``"none"``: the reasoning stays in the content. None:
            the format its chat template shows, if any.
        load_on_first_use: Load each model when its first request arrives
            (that request, and any that come meanwhile, wait for the one
            load) instead of at start-up.
        idle_unload_timeout: Seconds a model loaded on first use may be idle
            (no rows, no request waiting for it or holding it) before it is
            unloaded; the next request loads it again. None: never. Needs
            ``load_on_first_use``.
        max_model_bytes: Bytes of model weights loaded at once, over all
            models. Loading a model on first use past it first unloads the
            least recently used idle models loaded on first use; if it still
            does not fit, the request is a 503 with ``Retry-After``. Models
            loaded at start-up count and are never unloaded; more of them
            than fit fail the start-up. None: no limit.
        model_settings: Settings of each model on top of the server's, one
            mapping per model in the order of ``model`` (empty: none); keys
            from :data:`PER_MODEL_SETTINGS`. :meth:`for_model` gives a
            model's settings. A server-wide ``idle_unload_timeout`` applies
            to the models loaded on first use.
        distributed: ``tensor``: split the model over the ranks of an
            ``mx.distributed`` group (tensor parallelism; every rank runs the
            same command under ``mlx.launch``; rank 0 serves, the others
            follow); None: one process holds the whole model.
        distributed_timeout: Seconds a rank of the group may take to answer
            (a step, a collective) before the group counts as lost: rank 0's
            ``/health`` turns 503 and every rank exits with status 1.
        freeze_gc: After the model is loaded, collect garbage once and move
            every object left to the collector's permanent generation
            (:func:`gc.freeze`), so later full collections skip the
            libraries and the model, during which nothing on the event loop
            or the MLX thread runs. Process-wide, so off by default in the
            library; the command line turns it on.
    """

    model: str | tuple[str, ...] = _setting(
        "", "a local model folder or a Hugging Face hub id; several: a tuple"
    )
    served_model_name: str | tuple[str, ...] | None = _setting(
        None,
        "the model name clients send; once per MODEL, in the same order "
        "(default: MODEL as given)",
        parse=str,
        repeated=True,
    )
    max_tokens_limit: int = _setting(
        4096,
        "largest max_tokens a request may ask for (default: %(default)s)",
        parse=positive,
    )
    default_max_tokens: int = _setting(
        512,
        "max_tokens of a request that sets none (default: %(default)s)",
        parse=positive,
    )
    max_pending: int = _setting(
        256,
        "requests that may wait for the model before 503 (default: %(default)s)",
        parse=positive,
    )
    max_num_seqs: int = _setting(
        32,
        "generations decoded together in one batch (default: %(default)s)",
        parse=positive,
    )
    max_body_bytes: int = _setting(
        20 * 1024 * 1024,
        "largest request body (default: %(default)s)",
        parse=positive,
    )
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    api_key: str | None = _setting(
        None,
        "require 'Authorization: Bearer KEY' (default: $MLX_PINNED_API_KEY)",
        parse=str,
        env=API_KEY_ENV,
    )
    allowed_origins: tuple[str, ...] = _setting(
        (),
        "browser origins allowed to call the API (CORS), comma-separated, or "
        "'*' for any (default: none, CORS off)",
        parse=origins,
    )
    allow_remote_images: bool = _setting(
        False,
        "fetch http(s) image URLs, from public addresses only (default: off)",
    )
    remote_image_timeout: float = _setting(
        10.0,
        "seconds to fetch one remote image (default: %(default)s)",
        parse=positive_seconds,
    )
    max_prompt_tokens: int | None = _setting(
        None,
        "most prompt tokens, images included (default: the model's context length)",
        parse=positive,
    )
    request_timeout: float | None = _setting(
        600.0,
        "seconds a request may wait and generate before 504; 0: no limit "
        "(default: %(default)s)",
        parse=seconds_or_none,
    )
    load_wait: float | None = _setting(
        120.0,
        "seconds a request waits for its model to load before 503 "
        "model_not_loaded; 0: as long as the load takes (default: %(default)s)",
        parse=seconds_or_none,
    )
    drain_timeout: float = _setting(
        30.0,
        "seconds in-flight requests get at shut-down (default: %(default)s)",
        parse=seconds,
    )
    drain_seconds: float = _setting(
        0.0,
        "seconds to keep serving after SIGTERM with /health answering 503, "
        "before the listener closes, so balancers stop sending first "
        "(default: %(default)s)",
        parse=seconds,
    )
    retry_after: int = _setting(
        1,
        "seconds a client is asked to wait (Retry-After) when the server is "
        "busy (default: %(default)s)",
        parse=positive,
    )
    prompt_cache_bytes: int | None = _setting(
        None,
        "bytes of prompt KV kept for requests that start the same way (a chat's "
        "next turn), per model; 0: off (default: an eighth of the machine's "
        "memory, shared out among the models)",
        parse=non_negative,
    )
    image_cache_bytes: int | None = _setting(
        None,
        "bytes of vision-tower outputs kept for images sent again, per model; 0: "
        "off (default: a 32nd of the machine's memory, shared out among the "
        "models)",
        parse=non_negative,
    )
    prefill_step_size: int = _setting(
        2048,
        "prompt tokens prefilled in one pass, at most (default: %(default)s)",
        parse=positive,
    )
    tool_call_parser: str | None = _setting(
        None,
        "the format the model writes tool calls in: "
        + ", ".join(TOOL_CALL_FORMATS)
        + ", or 'none' for no tool calls (default: detected from its chat "
        "template)",
        parse=check_tool_call_parser,
    )
    reasoning_parser: str | None = _setting(
        None,
        "the format the model writes its reasoning in: "
        + ", ".join(REASONING_FORMATS)
        + ", or 'none' to keep it in the content (default: detected from its "
        "chat template)",
        parse=check_reasoning_parser,
    )
    load_on_first_use: bool = _setting(
        False,
        "load each model when its first request arrives, not at start-up "
        "(default: off)",
    )
    idle_unload_timeout: float | None = _setting(
        None,
        "seconds a model loaded on first use may sit idle (no rows, no waiting "
        "request) before it is unloaded; its next request loads it again; 0: "
        "never (default); needs --load-on-first-use",
        parse=seconds_or_none,
    )
    max_model_bytes: int | None = _setting(
        None,
        "bytes of model weights loaded at once, over all models; a load past it "
        "first unloads the least recently used idle models loaded on first use, "
        "else answers 503 (default: no limit)",
        parse=positive,
    )
    distributed: str | None = _setting(
        None,
        "'tensor': split the model over the ranks of an mx.distributed group "
        "(run every rank under mlx.launch; rank 0 serves HTTP) (default: off)",
        parse=distribution,
    )
    distributed_timeout: float = _setting(
        30.0,
        "seconds a rank of a --distributed group may take to answer before the "
        "group counts as lost and exits with status 1 (default: %(default)s)",
        parse=positive_seconds,
    )
    # Process-wide: a library user's app shares the process with other code.
    freeze_gc: bool = _setting(
        False,
        "freeze the objects left after the model load out of later garbage "
        "collections (default: on; --no-freeze-gc turns it off)",
        command_line_default=True,
    )
    # No flag: a config file (``mlx-pinned serve --config``) or create_app.
    model_settings: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _one_or_many("model", self.model))
        self._check_model_settings()
        if self.served_model_name is not None:
            names = _one_or_many("served_model_name", self.served_model_name)
            object.__setattr__(self, "served_model_name", names)
            given = 1 if isinstance(names, str) else len(names)
            if given != len(self.models):
                raise ValueError(
                    f"served_model_name gives {given} names for "
                    f"{len(self.models)} models: give one per model, in order"
                )
        taken = [name for name in self.names if self.names.count(name) > 1]
        if taken:
            raise ValueError(
                f"two models are served as {taken[0]!r}: give each its own "
                "served_model_name"
            )
        bounded = ("max_tokens_limit", "max_pending", "max_num_seqs")
        for name in (*bounded, "max_body_bytes", "retry_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if isinstance(self.allowed_origins, str):
            raise ValueError("allowed_origins is a sequence of origins, not one string")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if self.api_key == "":
            raise ValueError("api_key is empty: give a key, or None for no key")
        for name in ("prompt_cache_bytes", "image_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, not {value}")
        if self.prefill_step_size < 1:
            raise ValueError(
                f"prefill_step_size must be >= 1, not {self.prefill_step_size}"
            )
        if self.tool_call_parser is not None:
            check_tool_call_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            check_reasoning_parser(self.reasoning_parser)
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens must be >= 1, not {self.max_prompt_tokens}"
            )
        positive_times = ("request_timeout", "remote_image_timeout", "load_wait")
        for name in positive_times:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, not {value}")
        for name in ("drain_timeout", "drain_seconds"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be >= 0, not {value}")
        if self.idle_unload_timeout is not None:
            if not self.idle_unload_timeout > 0:
                raise ValueError(
                    "idle_unload_timeout must be > 0, not "
                    f"{self.idle_unload_timeout}: None never unloads"
                )
            lazy = self.load_on_first_use or any(
                own.get("load_on_first_use") for own in self.model_settings
            )
            if not lazy:
                raise ValueError(
                    "idle_unload_timeout needs load_on_first_use: models loaded "
                    "at start-up stay loaded"
                )
        if self.max_model_bytes is not None and self.max_model_bytes < 1:
            raise ValueError(
                f"max_model_bytes must be >= 1, not {self.max_model_bytes}"
            )
        if self.distributed not in (None, "tensor"):
            raise ValueError(
                f"distributed must be 'tensor' or None, not {self.distributed!r}"
            )
        if self.distributed is not None and len(self.models) > 1:
            raise ValueError("distributed serves one model: give one")
        if self.distributed is not None and self.load_on_first_use:
            # Every rank holds its part from the start to the stop.
            raise ValueError(
                "distributed loads the model at start-up: no load_on_first_use"
            )
        if not (
            self.distributed_timeout > 0 and math.isfinite(self.distributed_timeout)
        ):
            raise ValueError(
                f"distributed_timeout must be > 0, not {self.distributed_timeout}"
            )
        if self.default_max_tokens > self.max_tokens_limit:
            object.__setattr__(self, "default_max_tokens", self.max_tokens_limit)
        for index in range(len(self.model_settings)):
            self.for_model(index)  # each model's own settings, checked

    def _check_model_settings(self) -> None:
        settings = self.model_settings
        if isinstance(settings, dict) or not all(
            isinstance(own, dict) for own in settings
        ):
            raise ValueError("model_settings is a sequence of dicts, one per model")
        settings = tuple(dict(own) for own in settings)
        object.__setattr__(self, "model_settings", settings)
        if settings and len(settings) != len(self.models):
            raise ValueError(
                f"model_settings gives {len(settings)} for {len(self.models)} "
                "models: give one per model, in order (an empty one for none)"
            )
        for own in settings:
            unknown = sorted(set(own) - PER_MODEL_SETTINGS)
            if unknown:
                allowed = ", ".join(sorted(PER_MODEL_SETTINGS))
                raise ValueError(
                    f"{unknown[0]} is not a setting of one model: it applies to "
                    f"every model (a model may set {allowed})"
                )

    def for_model(self, index: int) -> ServerConfig:
        """The settings model ``index`` (in :attr:`models`) is served with:
        the server's, with its own :attr:`model_settings` on top, as a config
        of that one model. The default cache budgets stay shared out among
        all the models; a server-wide ``idle_unload_timeout`` applies to it
        only if it is loaded on first use.

        Raises:
            ValueError: Its own settings are out of range (names the field).
        """
        own = dict(self.model_settings[index]) if self.model_settings else {}
        own.setdefault("prompt_cache_bytes", self.prompt_cache_budget)
        own.setdefault("image_cache_bytes", self.image_cache_budget)
        if not own.get("load_on_first_use", self.load_on_first_use):
            own.setdefault("idle_unload_timeout", None)
        try:
            return dataclasses.replace(
                self,
                model=self.models[index],
                served_model_name=self.names[index],
                model_settings=(),
                **own,
            )
        except ValueError as exc:
            raise ValueError(f"model {self.names[index]!r}: {exc}") from None

    @property
    def models(self) -> tuple[str, ...]:
        """Every model folder or hub id served, in order."""
        return (self.model,) if isinstance(self.model, str) else self.model

    @property
    def names(self) -> tuple[str, ...]:
        """The name of each model in :attr:`models` in requests and
        ``/v1/models``: its ``served_model_name``, else the model as given."""
        names = self.served_model_name
        if names is None:
            return self.models
        return (names,) if isinstance(names, str) else names

    @property
    def name(self) -> str:
        """The first (or only) model's name in requests and ``/v1/models``."""
        return self.names[0]

    @property
    def prompt_cache_budget(self) -> int:
        """Each model's ``prompt_cache_bytes``; by default an eighth of the
        machine's memory, shared out among the models."""
        if self.prompt_cache_bytes is not None:
            return self.prompt_cache_bytes
        return _memory() // 8 // len(self.models)

    @property
    def image_cache_budget(self) -> int:
        """Each model's ``image_cache_bytes``; by default a 32nd of the
        machine's memory, shared out among the models."""
        if self.image_cache_bytes is not None:
            return self.image_cache_bytes
        return _memory() // 32 // len(self.models)

    @property
    def thread_bound(self) -> int:
        """The MLX thread's queue bound: each model's waiting room plus a
        turn of each of its running generations (the running ones are queued
        there too)."""
        if not self.model_settings:
            return (self.max_pending + self.max_num_seqs) * len(self.models)
        each = (self.for_model(index) for index in range(len(self.models)))
        return sum(own.max_pending + own.max_num_seqs for own in each)


def _one_or_many(name: str, value: object) -> str | tuple[str, ...]:
    """A string as it is; a sequence of strings as a tuple, or as its one
    string when it has one (so one model compares equal however given)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(item, str) for item in value
    ):
        raise ValueError(f"{name} is a string or a sequence of strings")
    if not value:
        raise ValueError(f"{name} is empty: give at least one")
    return value[0] if len(value) == 1 else tuple(value)


def _memory() -> int:
    """The machine's memory in bytes (8 GiB where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not POSIX
        return 8 * 2**30


@dataclass(frozen=True)
class Setting:
    """One command-line setting: where it goes and how it is read."""

    path: tuple[str, ...]  # the field, and the field inside it for limits
    flag: str
    help: str
    parse: Callable[[str], Any] | None
    default: Any
    env: str | None
    repeated: bool  # given once per model: the values, in order


def command_line_settings() -> Iterator[Setting]:
    """Every setting of :class:`ServerConfig` that has a flag, with the
    limits of :class:`ImageLimits` flattened (``--max-images``); ``model``
    is the command's positional argument and ``model_settings`` comes from
    a config file: they have none."""
    for item in dataclasses.fields(ServerConfig):
        if item.name in ("model", "model_settings"):
            continue
        if item.name == "image_limits":
            for inner in dataclasses.fields(ImageLimits):
                yield _as_setting((item.name, inner.name), inner)
            continue
        yield _as_setting((item.name,), item)


def _as_setting(path: tuple[str, ...], item: dataclasses.Field[Any]) -> Setting:
    meta = item.metadata
    default = meta["command_line_default"]
    if default is dataclasses.MISSING:
        default = item.default
    flag = meta["flag"] or "--" + path[-1].replace("_", "-")
    return Setting(
        path, flag, meta["help"], meta["parse"], default, meta["env"], meta["repeated"]
    )
