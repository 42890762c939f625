"""The checks of :class:`~.config.ServerConfig`, in one place: each
setting's range and the settings that depend on each other.

A config runs them as it is made (and again for each model's own settings,
:meth:`~.config.ServerConfig.for_model`); a bad setting is a
:class:`SettingError` that names it. A plain shared module: any thread.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from .formats import check_reasoning_parser, check_tool_call_parser

if TYPE_CHECKING:
    from .config import ImageLimits, ServerConfig

__all__ = [
    "CHAT_SETTINGS",
    "MODEL_KINDS",
    "PER_MODEL_SETTINGS",
    "SettingError",
    "check_config",
    "check_limits",
]

#: The settings a model may set for itself (:attr:`ServerConfig.model_settings`,
#: a config file's ``[[models]]`` entries); the others are the server's.
PER_MODEL_SETTINGS = frozenset(
    {
        "model_kind",
        "load_on_first_use",
        "idle_unload_timeout",
        "max_num_seqs",
        "max_pending",
        "prompt_cache_bytes",
        "image_cache_bytes",
        "prefill_step_size",
        "prefill_step_seconds",
        "tool_call_parser",
        "reasoning_parser",
        "kv_bits",
        "kv_group_size",
        "prompt_lookup_tokens",
        "num_draft_tokens",
        "draft_model",
        "draft_max_batch",
    }
)


class SettingError(ValueError):
    """A setting out of its range, or at odds with another.

    Attributes:
        setting: The field the message is about (the message's first word,
            where it starts with it).
    """

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def check_limits(limits: ImageLimits) -> None:
    """Every limit of ``limits`` is at least 1."""
    for name in ("max_images", "max_bytes", "max_pixels"):
        _at_least(limits, name, 1)


def check_config(config: ServerConfig) -> None:
    """Check ``config`` and put its settings in their one form (one model as
    a string, several as a tuple; origins as a tuple; ``default_max_tokens``
    at most ``max_tokens_limit``)."""
    _set(config, "model", _one_or_many("model", config.model))
    _check_model_settings(config)
    _check_names(config)
    positive = ("max_tokens_limit", "default_max_tokens", "max_pending")
    for name in (*positive, "max_num_seqs", "max_body_bytes", "retry_after"):
        _at_least(config, name, 1)
    _at_least(config, "prefill_step_size", 1)
    for name in ("max_prompt_tokens", "max_model_bytes"):
        _at_least(config, name, 1, optional=True)
    for name in ("max_videos", "max_video_bytes", "max_video_pixels"):
        _at_least(config, name, 1)
    _at_least(config, "max_video_frames", 2)  # a temporal patch is two frames
    for name in ("max_audios", "max_audio_bytes"):
        _at_least(config, name, 1)
    for name in ("max_video_seconds", "video_fps", "max_audio_seconds"):
        _seconds(config, name, positive=True, finite=True)
    for name in ("prompt_cache_bytes", "image_cache_bytes", "mlx_cache_bytes"):
        _at_least(config, name, 0, optional=True)
    for name in ("responses_store_max", "responses_store_bytes"):
        _at_least(config, name, 0)
    _at_least(config, "prompt_cache_disk_bytes", 0)
    _check_origins(config)
    _check_state_dir(config)
    if config.api_key == "":
        raise SettingError("api_key", "api_key is empty: give a key, or leave it unset")
    for name, check in (
        ("tool_call_parser", check_tool_call_parser),
        ("reasoning_parser", check_reasoning_parser),
    ):
        if getattr(config, name) is not None:
            try:
                check(getattr(config, name))
            except ValueError as exc:
                raise SettingError(name, str(exc)) from None
    for name in ("request_timeout", "remote_image_timeout", "prefill_step_seconds"):
        _seconds(config, name, positive=True, optional=True)
    _seconds(config, "load_wait", optional=True)
    for name in ("unready_seconds", "in_flight_timeout", "stream_write_interval"):
        _seconds(config, name, finite=True)
    _seconds(config, "distributed_timeout", positive=True, finite=True)
    _check_kind(config)
    _check_residency(config)
    _check_distributed(config)
    _check_kv_quant(config)
    _check_drafting(config)
    if config.default_max_tokens > config.max_tokens_limit:
        _set(config, "default_max_tokens", config.max_tokens_limit)
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


#: The settings only a chat model has: an encoder (embedding, rerank) model
#: that sets one is refused; the server's do not apply to it.
CHAT_SETTINGS = frozenset(
    {
        "kv_bits",
        "prompt_lookup_tokens",
        "draft_model",
        "tool_call_parser",
        "reasoning_parser",
    }
)

#: The kinds of model a server serves, each through its own routes.
MODEL_KINDS = ("chat", "embedding", "rerank", "transcription", "speech")


def _check_kind(config: ServerConfig) -> None:
    if config.model_kind not in MODEL_KINDS:
        raise SettingError(
            "model_kind",
            f"model_kind must be one of {', '.join(MODEL_KINDS)}, not "
            f"{config.model_kind!r}",
        )
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
    if config.distributed is None:
        return
    if config.distributed != "tensor":
        raise SettingError(
            "distributed",
            f"distributed must be 'tensor' or None, not {config.distributed!r}",
        )
    if len(config.models) > 1:
        raise SettingError("distributed", "distributed serves one model: give one")
    if config.load_on_first_use:
        # Every rank holds its part from the start to the stop.
        raise SettingError(
            "distributed",
            "distributed loads the model at start-up: no load_on_first_use",
        )


def _check_kv_quant(config: ServerConfig) -> None:
    bits, group = config.kv_bits, config.kv_group_size
    if bits is not None and (isinstance(bits, bool) or bits not in (4, 8)):
        raise SettingError(
            "kv_bits",
            f"kv_bits must be 4 or 8 (or unset: no quantization), not {bits!r}",
        )
    if isinstance(group, bool) or group not in (32, 64, 128):
        raise SettingError(
            "kv_group_size", f"kv_group_size must be 32, 64 or 128, not {group!r}"
        )
    if bits is not None and config.distributed is not None:
        raise SettingError(
            "kv_bits", "kv_bits is not offered with distributed: unset one of them"
        )


def _check_drafting(config: ServerConfig) -> None:
    """Speculative decoding: a draft count, one source of drafts, one
    process."""
    _at_least(config, "prompt_lookup_tokens", 0)
    _at_least(config, "num_draft_tokens", 1)
    _at_least(config, "draft_max_batch", 0)
    draft = config.draft_model
    if draft is not None and (not isinstance(draft, str) or not draft.strip()):
        raise SettingError(
            "draft_model",
            f"draft_model must be a model's folder or hub id, not {draft!r}",
        )
    if draft is not None and config.prompt_lookup_tokens > 0:
        raise SettingError(
            "draft_model",
            "draft_model and prompt_lookup_tokens are two sources of drafts: "
            "set one of them",
        )
    for name in ("prompt_lookup_tokens", "draft_model"):
        if getattr(config, name) and config.distributed is not None:
            raise SettingError(name, f"{name} needs one process: not with distributed")


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
    for own in settings:
        unknown = sorted(set(own) - PER_MODEL_SETTINGS)
        if unknown:
            allowed = ", ".join(sorted(PER_MODEL_SETTINGS))
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


def _at_least(settings: object, name: str, low: int, *, optional: bool = False) -> None:
    """``settings.name`` is a whole number of at least ``low`` (or None,
    where ``optional``)."""
    value = getattr(settings, name)
    if optional and value is None:
        return
    if not value >= low:
        raise SettingError(name, f"{name} must be >= {low}, not {value}")


def _seconds(
    settings: object,
    name: str,
    *,
    positive: bool = False,
    optional: bool = False,
    finite: bool = False,
) -> None:
    """``settings.name`` is a number of seconds: 0 or more, or more than 0
    where ``positive``; None too where ``optional``; not infinite where
    ``finite``. Never nan."""
    value = getattr(settings, name)
    if optional and value is None:
        return
    bound = "> 0" if positive else ">= 0"
    in_range = value > 0 if positive else value >= 0  # False for nan
    if not in_range or (finite and not math.isfinite(value)):
        raise SettingError(name, f"{name} must be {bound}, not {value}")
