"""How ``mlx-pinned serve`` spells each setting of :class:`~.config.ServerConfig`.

One :class:`Option` per field (a limit of :class:`~.config.ImageLimits` is
``image_limits.<name>``), keyed by the field's name: its flag, its help, how
the flag's text is read, and the command line's own default where it has
one. A config file's keys are the same flags, without their dashes and with
``_`` for ``-``. What a value may be is the config's to check, not this
table's: a parser here only reads text as a number, a list or a name. Runs
on the main thread, before the server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import ImageLimits, ServerConfig
from .formats import REASONING_FORMATS, TOOL_CALL_FORMATS

__all__ = [
    "API_KEY_ENV",
    "AS_THE_FIELD",
    "NOT_ON_THE_COMMAND_LINE",
    "OPTIONS",
    "Option",
    "add_options",
    "origins",
    "seconds",
    "seconds_or_none",
    "whole",
]


def whole(text: str) -> int:
    """A whole number."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a whole number, not {text!r}") from None


def seconds(text: str) -> float:
    """A number of seconds."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number of seconds, not {text!r}") from None


def seconds_or_none(text: str) -> float | None:
    """A number of seconds; 0 means no limit (None)."""
    return seconds(text) or None


def origins(text: str) -> tuple[str, ...]:
    """Comma-separated origins (``https://app.example``), or ``*`` for any."""
    found = tuple(item.strip().rstrip("/") for item in text.split(",") if item.strip())
    if not found:
        raise ValueError("give at least one origin, e.g. https://app.example")
    return found


#: The environment variable that gives ``--api-key``'s default.
API_KEY_ENV = "MLX_PINNED_API_KEY"

#: The fields that have no flag, and where the command line takes them from.
NOT_ON_THE_COMMAND_LINE = {
    "model": "the command's MODEL arguments, or a config file's [[models]]",
    "image_limits": "a flag for each limit (image_limits.<name>)",
    "model_settings": "a config file's [[models]] tables",
}


#: :attr:`Option.default` where the command line's default is the field's.
AS_THE_FIELD: Any = object()


@dataclass(frozen=True)
class Option:
    """One setting on the command line.

    Attributes:
        setting: The field (``image_limits.max_bytes`` for a limit).
        help: The flag's help; ``%(default)s`` is the command line's default.
        parse: Reads the flag's text as the field's value; its ValueError
            is the usage error's text. None: a switch (``--x``; also
            ``--no-x`` where it is on by default).
        flag: The flag, where it is not the field's name with dashes.
        env: The environment variable that gives the default, if set.
        default: The command line's own default, where it is not the
            field's (:data:`AS_THE_FIELD`: the field's).
        repeated: Given once per model: the values, in order.
    """

    setting: str
    help: str
    parse: Callable[[str], Any] | None = None
    flag: str = ""
    env: str | None = None
    default: Any = AS_THE_FIELD
    repeated: bool = False

    def __post_init__(self) -> None:
        if not self.flag:
            name = self.setting.rpartition(".")[2]
            object.__setattr__(self, "flag", "--" + name.replace("_", "-"))

    @property
    def key(self) -> str:
        """Its key in a config file: ``max_num_seqs`` for ``--max-num-seqs``."""
        return self.flag[2:].replace("-", "_")

    def command_line_default(self) -> Any:
        """What the command line sets where the flag is not given."""
        if self.default is not AS_THE_FIELD:
            return self.default
        owner, _, name = self.setting.rpartition(".")
        fields = dataclasses.fields(ImageLimits if owner else ServerConfig)
        (found,) = (item for item in fields if item.name == name)
        return found.default


OPTIONS = (
    Option(
        "served_model_name",
        "the model name clients send; once per MODEL, in the same order "
        "(default: MODEL as given)",
        str,
        repeated=True,
    ),
    Option(
        "max_tokens_limit",
        "largest max_tokens a request may ask for (default: %(default)s)",
        whole,
    ),
    Option(
        "default_max_tokens",
        "max_tokens of a request that sets none (default: %(default)s)",
        whole,
    ),
    Option(
        "max_pending",
        "requests that may wait for the model before 503 (default: %(default)s)",
        whole,
    ),
    Option(
        "max_num_seqs",
        "generations decoded together in one batch (default: %(default)s)",
        whole,
    ),
    Option("max_body_bytes", "largest request body (default: %(default)s)", whole),
    Option(
        "image_limits.max_images",
        "images per request (default: %(default)s)",
        whole,
    ),
    Option(
        "image_limits.max_bytes",
        "encoded bytes per image (default: %(default)s)",
        whole,
        flag="--max-image-bytes",
    ),
    Option(
        "image_limits.max_pixels",
        "width x height per image (default: %(default)s)",
        whole,
        flag="--max-image-pixels",
    ),
    Option(
        "api_key",
        f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
        str,
        env=API_KEY_ENV,
    ),
    Option(
        "allowed_origins",
        "browser origins allowed to call the API (CORS), comma-separated, or "
        "'*' for any (default: none, CORS off)",
        origins,
    ),
    Option(
        "allow_remote_images",
        "fetch http(s) image and video URLs, from public addresses only (default: off)",
    ),
    Option(
        "remote_image_timeout",
        "seconds to fetch one remote image or video (default: %(default)s)",
        seconds,
    ),
    Option("max_videos", "videos per request (default: %(default)s)", whole),
    Option("max_video_bytes", "encoded bytes per video (default: %(default)s)", whole),
    Option("max_video_seconds", "seconds per video (default: %(default)s)", seconds),
    Option("max_audios", "audio files per chat request (default: %(default)s)", whole),
    Option(
        "max_audio_bytes", "encoded bytes per audio file (default: %(default)s)", whole
    ),
    Option(
        "max_audio_seconds", "seconds per audio file (default: %(default)s)", seconds
    ),
    Option(
        "max_video_pixels",
        "width x height per video frame (default: %(default)s)",
        whole,
    ),
    Option(
        "video_fps",
        "frames sampled per second of video, where a request sets no video_fps "
        "(default: %(default)s)",
        seconds,
    ),
    Option(
        "max_video_frames",
        "most frames sampled per video (default: %(default)s)",
        whole,
    ),
    Option(
        "max_prompt_tokens",
        "most prompt tokens, images included (default: the model's context length)",
        whole,
    ),
    Option(
        "request_timeout",
        "seconds a request may wait and generate before 504; 0: no limit "
        "(default: %(default)s)",
        seconds_or_none,
    ),
    Option(
        "stream_write_interval",
        "seconds a streamed answer waits at least between two writes (its first "
        "token goes out at once): tokens that come faster go out together; 0: a "
        "write per wake-up (default: %(default)s)",
        seconds,
    ),
    Option(
        "load_wait",
        "seconds a request waits for its model to load before 503 "
        "model_not_loaded; 0: the 503 at once, for replicas behind a balancer "
        "that retries elsewhere (default: %(default)s)",
        seconds,
    ),
    Option(
        "unready_seconds",
        "on SIGTERM, seconds to keep serving with /health answering 503 before "
        "the listener closes, so balancers stop sending first (default: "
        "%(default)s)",
        seconds,
    ),
    Option(
        "in_flight_timeout",
        "seconds the requests in flight get to finish once the listener is "
        "closed (default: %(default)s)",
        seconds,
    ),
    Option(
        "retry_after",
        "seconds a client is asked to wait (Retry-After) when the server is "
        "busy (default: %(default)s)",
        whole,
    ),
    Option(
        "prompt_cache_bytes",
        "bytes of prompt KV kept for requests that start the same way (a chat's "
        "next turn), per model; 0: off (default: an eighth of the machine's "
        "memory, shared out among the models)",
        whole,
    ),
    Option(
        "image_cache_bytes",
        "bytes of vision-tower outputs kept for images sent again, per model; 0: "
        "off (default: a 32nd of the machine's memory, shared out among the "
        "models)",
        whole,
    ),
    Option(
        "mlx_cache_bytes",
        "bytes of freed buffers MLX keeps for reuse (its buffer cache, emptied "
        "when a batch ends); 0: none (default: MLX's own limit or an eighth of "
        "the machine's memory, whichever is smaller)",
        whole,
    ),
    Option(
        "prefill_step_size",
        "prompt tokens prefilled in one pass, at most (default: %(default)s)",
        whole,
    ),
    Option(
        "prefill_step_seconds",
        "seconds a pass of a long prompt's prefill takes, about, while other "
        "streams decode (they wait for it); 0: passes of --prefill-step-size "
        "tokens (default: %(default)s)",
        seconds_or_none,
    ),
    Option(
        "tool_call_parser",
        "the format the model writes tool calls in: "
        + ", ".join(TOOL_CALL_FORMATS)
        + ", or 'none' for no tool calls (default: detected from its chat "
        "template)",
        str,
    ),
    Option(
        "reasoning_parser",
        "the format the model writes its reasoning in: "
        + ", ".join(REASONING_FORMATS)
        + ", or 'none' to keep it in the content (default: detected from its "
        "chat template)",
        str,
    ),
    Option(
        "model_kind",
        "what the models are served as: 'chat' (the chat and completion routes), "
        "'embedding' (/v1/embeddings, through mlx-vlm's embedding loader), "
        "'rerank' (/v1/rerank, a cross-encoder through mlx-vlm's reranker "
        "loader), 'transcription' (/v1/audio/transcriptions and "
        "/v1/audio/translations, through mlx-audio's speech-to-text loader) "
        "or 'speech' (/v1/audio/speech, through mlx-audio's text-to-speech "
        "loader); a config file sets it per model (default: %(default)s)",
        str,
    ),
    Option(
        "load_on_first_use",
        "load each model when its first request arrives, not at start-up "
        "(default: off)",
    ),
    Option(
        "idle_unload_timeout",
        "seconds a model loaded on first use may sit idle (no rows, no waiting "
        "request) before it is unloaded; its next request loads it again; 0: "
        "never (default); needs --load-on-first-use",
        seconds_or_none,
    ),
    Option(
        "max_model_bytes",
        "bytes of model weights loaded at once, over all models; a load past it "
        "first unloads the least recently used idle models loaded on first use, "
        "else answers 503 (default: no limit)",
        whole,
    ),
    Option(
        "distributed",
        "'tensor': split the model over the ranks of an mx.distributed group "
        "(run every rank under mlx.launch; rank 0 serves HTTP) (default: off)",
        str,
    ),
    Option(
        "distributed_timeout",
        "seconds a rank of a --distributed group may take to answer before the "
        "group counts as lost and exits with status 1 (default: %(default)s)",
        seconds,
    ),
    Option(
        "responses_store_max",
        "responses kept for GET /v1/responses/{id} and "
        "previous_response_id, oldest out first; 0: none (default: %(default)s)",
        whole,
    ),
    Option(
        "responses_store_bytes",
        "bytes the kept responses may take, oldest out first (default: %(default)s)",
        whole,
    ),
    Option(
        "state_dir",
        "a folder for what a restart keeps: the stored responses (a SQLite "
        "database) and the prompt and image caches' files, made if missing "
        "(default: none, memory only)",
        str,
    ),
    Option(
        "prompt_cache_disk_bytes",
        "bytes of prompt KV and image files each model keeps under "
        "--state-dir; 0: none (default: %(default)s)",
        whole,
    ),
    # On here, off in the library: the command owns its process.
    Option(
        "freeze_gc",
        "freeze the objects left after the model load out of later garbage "
        "collections (default: on; --no-freeze-gc turns it off)",
        default=True,
    ),
    Option(
        "playground",
        "serve the chat page at / (default: on; --no-playground turns it off)",
    ),
    # The quantized KV cache.
    Option(
        "kv_bits",
        "quantize the KV cache to 4 or 8 bits per value (default: off)",
        whole,
    ),
    Option(
        "kv_group_size",
        "values sharing one scale under --kv-bits: 32, 64 or 128 (default: "
        "%(default)s)",
        whole,
    ),
    # Speculative decoding (engine/drafting.py).
    Option(
        "prompt_lookup_tokens",
        "speculative decoding by prompt lookup: draft the tokens that followed "
        "the latest earlier match of a row's last N tokens (N down to 1) in its "
        "prompt and answer, verified in the batch's forward pass; 0: off "
        "(default: %(default)s)",
        whole,
    ),
    Option(
        "num_draft_tokens",
        "draft tokens per row and step, at most (default: %(default)s)",
        whole,
    ),
    Option(
        "draft_model",
        "speculative decoding with a draft model: a small model with the served "
        "model's tokenizer (a folder or a hub id) drafts each row's next tokens, "
        "verified in the batch's forward pass (default: off)",
        str,
    ),
    Option(
        "draft_max_batch",
        "speculative steps only while the batch has at most N rows; 0: at any "
        "size (default: %(default)s)",
        whole,
    ),
)


def add_options(parser: argparse.ArgumentParser) -> None:
    """A flag for each of :data:`OPTIONS`, whose destination is its setting
    (``image_limits.max_bytes``) and which sets nothing when not given: the
    namespace holds the flags given, and only those."""
    for option in OPTIONS:
        metavar = option.key.upper()
        shown = {"default": option.command_line_default()}
        common: dict[str, Any] = {
            "dest": option.setting,
            "default": argparse.SUPPRESS,
            "help": option.help % shown,
        }
        if option.parse is None:  # a switch
            on = option.command_line_default()
            action = argparse.BooleanOptionalAction if on else "store_true"
            parser.add_argument(option.flag, action=action, **common)
        else:
            parser.add_argument(
                option.flag,
                type=_argument(option.parse),
                action="append" if option.repeated else "store",
                metavar=metavar,
                **common,
            )


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError becomes the usage error's text."""

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = parse.__name__  # argparse names it in some messages
    return read
