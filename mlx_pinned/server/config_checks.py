"""How a setting is declared (:func:`setting`) and checked: each field's
own check as the config is made, then the checks of settings that depend
on each other. Any thread.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .kinds import kind_named

if TYPE_CHECKING:
    from .config import ServerConfig

__all__ = [
    "SAME",
    "Check",
    "Setting",
    "SettingError",
    "at_least",
    "check_config",
    "check_fields",
    "declared",
    "duration",
    "given",
    "one_of",
    "origins",
    "parser",
    "seconds",
    "seconds_or_none",
    "setting",
    "whole",
]

#: Checks a field's value, given its name; raises :class:`SettingError`.
Check = Callable[[str, Any], None]

#: :attr:`Setting.cli` where the command line's default is the field's.
SAME: Any = object()


class SettingError(ValueError):
    """A setting out of its range, or at odds with another; ``setting`` is
    the field the message is about."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class Setting:
    """What a field declares besides its type, its default and its help
    (the string under it, in Markdown, naming other settings by flag).

    Attributes:
        scope: ``model``: a model may set its own (``model_settings``), if
            its kind honours it.
        parse: Reads the flag's text; None: by the field's type.
        flag: Its flag, where it is not the field's name with dashes.
        shown: The default in words, where the value does not say it.
        cli: The command line's own default (:data:`SAME`: the field's).
        env: The environment variable that gives the command line's default.
    """

    check: Check | None = None
    scope: Literal["server", "model"] = "server"
    parse: Callable[[str], Any] | None = None
    flag: str | None = None
    shown: str | None = None
    cli: Any = SAME
    env: str | None = None
    repeated: bool = False

    @property
    def per_model(self) -> bool:
        return self.scope == "model"


def setting(default: Any, check: Check | None = None, **declared: Any) -> Any:
    """A dataclass field that declares a setting (:class:`Setting`)."""
    metadata = {"setting": Setting(check, **declared)}
    return dataclasses.field(default=default, metadata=metadata)


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    for item in dataclasses.fields(cls):
        if "setting" in item.metadata:
            yield item, item.metadata["setting"]


def whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a whole number, not {text!r}") from None


def seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number of seconds, not {text!r}") from None


def seconds_or_none(text: str) -> float | None:
    """0 means no limit (None)."""
    return seconds(text) or None


def origins(text: str) -> tuple[str, ...]:
    """Comma-separated origins (``https://app.example``), or ``*`` for any."""
    found = tuple(item.strip().rstrip("/") for item in text.split(",") if item.strip())
    if not found:
        raise ValueError("give at least one origin, e.g. https://app.example")
    return found


def at_least(low: int, *, optional: bool = False) -> Check:

    def check(name: str, value: Any) -> None:
        if not (optional and value is None) and not value >= low:
            raise SettingError(name, f"{name} must be >= {low}, not {value}")

    return check


def duration(
    *, positive: bool = False, optional: bool = False, finite: bool = False
) -> Check:
    """Seconds: 0 or more (more than 0 where ``positive``); never nan."""

    def check(name: str, value: Any) -> None:
        if optional and value is None:
            return
        in_range = value > 0 if positive else value >= 0  # False for nan
        if not in_range or (finite and not math.isfinite(value)):
            bound = "> 0" if positive else ">= 0"
            raise SettingError(name, f"{name} must be {bound}, not {value}")

    return check


def one_of(*values: Any, optional: bool = False) -> Check:
    *most, last = [
        repr(value) if isinstance(value, str) else str(value) for value in values
    ]
    words = f"{', '.join(most)} or {last}" if most else last
    unset = " (or unset)" if optional else ""

    def check(name: str, value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or value not in values:
            raise SettingError(name, f"{name} must be {words}{unset}, not {value!r}")

    return check


def given(what: str) -> Check:
    """A string that is not blank (or None); ``what`` names it in errors."""

    def check(name: str, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            raise SettingError(name, f"{name} must be {what}, not {value!r}")
        if not value.strip():
            raise SettingError(name, f"{name} is empty: give {what}, or leave it unset")

    return check


def parser(read: Callable[[str], object]) -> Check:
    """A name ``read`` takes (or None); its ValueError is the message."""

    def check(name: str, value: Any) -> None:
        if value is not None:
            try:
                read(value)
            except ValueError as exc:
                raise SettingError(name, str(exc)) from None

    return check


def check_fields(settings: object) -> None:
    for item, declaration in declared(type(settings)):
        if declaration.check is not None:
            declaration.check(item.name, getattr(settings, item.name))


def check_config(config: ServerConfig) -> None:
    """Check ``config`` and put its settings in their one form (one model as
    a string, several as a tuple; origins as a tuple; ``default_max_tokens``
    at most ``max_tokens_limit``)."""
    _set(config, "model", _one_or_many("model", config.model))
    _check_model_settings(config)
    _check_names(config)
    check_fields(config)
    _check_origins(config)
    _check_state_dir(config)
    _check_kind(config)
    _check_residency(config)
    _check_distributed(config)
    _check_drafting(config)
    limit = config.max_tokens_limit
    if limit is not None and config.default_max_tokens > limit:
        _set(config, "default_max_tokens", limit)
    for index in range(len(config.model_settings)):
        config.for_model(index)  # each model's own settings, checked


def _check_names(config: ServerConfig) -> None:
    if config.served_model_name is not None:
        names = _one_or_many("served_model_name", config.served_model_name)
        _set(config, "served_model_name", names)
        given = 1 if isinstance(names, str) else len(names)
        if given != len(config.models):
            raise SettingError(
                "served_model_name",
                f"served_model_name gives {given} names for "
                f"{len(config.models)} models: give one per model, in order",
            )
    taken = [name for name in config.names if config.names.count(name) > 1]
    if taken:
        raise SettingError(
            "served_model_name",
            f"two models are served as {taken[0]!r}: give each its own "
            "served_model_name",
        )


def _check_origins(config: ServerConfig) -> None:
    if isinstance(config.allowed_origins, str):
        raise SettingError(
            "allowed_origins",
            "allowed_origins is a sequence of origins, not one string",
        )
    _set(config, "allowed_origins", tuple(config.allowed_origins))
    for origin in config.allowed_origins:
        if origin != "*" and "://" not in origin:
            raise SettingError(
                "allowed_origins",
                f"allowed_origins gives {origin!r}: an origin is scheme://host[:port]",
            )


def _check_kind(config: ServerConfig) -> None:
    try:
        kind_named(config.model_kind)
    except ValueError as exc:
        raise SettingError("model_kind", str(exc)) from None
    if config.model_kind != "chat" and config.distributed is not None:
        raise SettingError(
            "model_kind", "distributed serves a chat model: model_kind 'chat'"
        )


def _check_state_dir(config: ServerConfig) -> None:
    """A folder's path, kept as a string (opened when the app is made)."""
    folder = config.state_dir
    if folder is None:
        return
    if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
        raise SettingError(
            "state_dir", f"state_dir must be a folder's path, not {folder!r}"
        )
    _set(config, "state_dir", os.fspath(folder))


def _check_residency(config: ServerConfig) -> None:
    if config.idle_unload_timeout is None:
        return
    if not config.idle_unload_timeout > 0:
        raise SettingError(
            "idle_unload_timeout",
            "idle_unload_timeout must be > 0, not "
            f"{config.idle_unload_timeout}: None never unloads",
        )
    lazy = config.load_on_first_use or any(
        own.get("load_on_first_use") for own in config.model_settings
    )
    if not lazy:
        raise SettingError(
            "idle_unload_timeout",
            "idle_unload_timeout needs load_on_first_use: models loaded at "
            "start-up stay loaded",
        )


def _check_distributed(config: ServerConfig) -> None:
    """What a tensor-parallel group cannot take: each rank replays rank 0's
    batch, so each must hold the same caches (docs/distributed.md)."""
    if config.distributed is None:
        return
    if len(config.models) > 1:
        raise SettingError("distributed", "distributed serves one model: give one")
    if config.load_on_first_use:
        # Every rank holds its part from the start to the stop.
        raise SettingError(
            "distributed",
            "distributed loads the model at start-up: no load_on_first_use",
        )
    if config.kv_bits is not None:
        raise SettingError(
            "kv_bits", "kv_bits is not offered with distributed: unset one of them"
        )
    for name in ("prompt_lookup_tokens", "draft_model"):
        if getattr(config, name):
            raise SettingError(name, f"{name} needs one process: not with distributed")
    if config.state_dir is not None and config.prompt_cache_disk_bytes > 0:
        raise SettingError(
            "state_dir",
            "state_dir keeps prompt cache files, which distributed cannot share "
            "between ranks: set prompt_cache_disk_bytes 0 (the stored responses "
            "stay there), or unset one of them",
        )


def _check_drafting(config: ServerConfig) -> None:
    if config.draft_model is not None and config.prompt_lookup_tokens > 0:
        raise SettingError(
            "draft_model",
            "draft_model and prompt_lookup_tokens are two sources of drafts: "
            "set one of them",
        )


def _check_model_settings(config: ServerConfig) -> None:
    settings = config.model_settings
    if isinstance(settings, dict) or not all(isinstance(own, dict) for own in settings):
        raise SettingError(
            "model_settings", "model_settings is a sequence of dicts, one per model"
        )
    settings = tuple(dict(own) for own in settings)
    _set(config, "model_settings", settings)
    if settings and len(settings) != len(config.models):
        raise SettingError(
            "model_settings",
            f"model_settings gives {len(settings)} for {len(config.models)} "
            "models: give one per model, in order (an empty one for none)",
        )
    own_settings = {
        item.name for item, each in declared(type(config)) if each.per_model
    }
    for own in settings:
        unknown = sorted(set(own) - own_settings)
        if unknown:
            allowed = ", ".join(sorted(own_settings))
            raise SettingError(
                "model_settings",
                f"{unknown[0]} is not a setting of one model: it applies to "
                f"every model (a model may set {allowed})",
            )


def _one_or_many(name: str, value: object) -> str | tuple[str, ...]:
    """A string as it is; a sequence of strings as a tuple, or as its one
    string when it has one (so one model compares equal however given)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(item, str) for item in value
    ):
        raise SettingError(name, f"{name} is a string or a sequence of strings")
    if not value:
        raise SettingError(name, f"{name} is empty: give at least one")
    return value[0] if len(value) == 1 else tuple(value)


def _set(config: ServerConfig, name: str, value: Any) -> None:
    object.__setattr__(config, name, value)  # a frozen dataclass, as it is made
