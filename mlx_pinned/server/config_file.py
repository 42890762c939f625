"""``mlx-pinned serve --config FILE``: the models and settings of a TOML file
(docs/server.md, "A config file"). A key is a flag without its dashes and
with ``_`` for ``-``, read as the flag is; the ranges are the config's to
check once the flags are on top. Runs on the main thread, before the server
starts.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cli_options import OPTIONS, Option
from .config import PER_MODEL_SETTINGS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigFile", "read_config_file"]


@dataclass(frozen=True)
class ConfigFile:
    """What a config file says.

    Attributes:
        names: Each model's served name (its path where it gives none).
        settings: The server's settings by field (``max_num_seqs``,
            ``image_limits.max_images``), as the flags would give them.
    """

    models: tuple[str, ...]
    names: tuple[str, ...]
    settings: dict[str, Any]
    model_settings: tuple[dict[str, Any], ...]


def read_config_file(path: str | Path) -> ConfigFile:
    """Read a config file.

    Raises:
        ValueError: Not TOML, or a key or value this server does not take;
            the message names the file and the key.
        OSError: It cannot be read.
    """
    with open(path, "rb") as file:
        try:
            data = tomllib.load(file)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not TOML: {exc}") from None
    try:
        return _read(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read(data: dict[str, Any]) -> ConfigFile:
    by_key = {o.key: o for o in OPTIONS if o.setting != "served_model_name"}
    entries = data.pop("models", None)
    if not isinstance(entries, list) or not entries:
        raise ValueError("give the models as [[models]] tables, each with a path")
    for key in ("model", "served_model_name"):
        if key in data:
            raise ValueError(f"{key} goes in each [[models]] table (path, name)")
    settings = {}
    for key, value in data.items():
        option = _option(by_key, key, "a setting of the server")
        settings[option.setting] = _value(key, option, value)
    models, names, own = [], [], []
    for index, entry in enumerate(entries):
        where = f"models[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} is a table ([[models]])")
        entry = dict(entry)
        model = entry.pop("path", None)
        if not isinstance(model, str) or not model:
            raise ValueError(f"{where} needs a path: a model folder or a hub id")
        name = entry.pop("name", model)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name is the name clients send, a string")
        values = {}
        for key, value in entry.items():
            if key not in PER_MODEL_SETTINGS:
                allowed = ", ".join(["path", "name", *sorted(PER_MODEL_SETTINGS)])
                raise ValueError(
                    f"{where}.{key}: a model sets only {allowed}; other settings "
                    "are the server's (outside [[models]])"
                )
            option = _option(by_key, key, "a setting")
            values[key] = _value(f"{where}.{key}", option, value)
        models.append(model)
        names.append(name)
        own.append(values)
    return ConfigFile(tuple(models), tuple(names), settings, tuple(own))


def _option(by_key: dict[str, Option], key: str, what: str) -> Option:
    try:
        return by_key[key]
    except KeyError:
        raise ValueError(
            f"{key} is not {what}: use a flag of `mlx-pinned serve` without its "
            "dashes and with '_' for '-'"
        ) from None


def _value(key: str, option: Option, value: Any) -> Any:
    """``value`` as its flag would give it."""
    if option.parse is None:
        if not isinstance(value, bool):
            raise ValueError(f"{key} is true or false, not {value!r}")
        return value
    if isinstance(value, bool) or (isinstance(value, (dict, list)) and not value):
        raise ValueError(f"{key}: {value!r} is not a value of {option.flag}")
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    try:
        return option.parse(text)
    except ValueError as exc:
        raise ValueError(f"{key} {exc}") from None
