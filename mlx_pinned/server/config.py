"""Every setting of the server, declared once: its type, default, help (the
string under it), check and whether a model may set it for itself. The
command line, config file and docs' table derive from these (:mod:`.cli_options`).
Any thread.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_checks import (
    SettingError,
    at_least,
    check_config,
    check_fields,
    declared,
    duration,
    given,
    one_of,
    origins,
    parser,
    seconds,
    setting,
)
from .formats import check_reasoning_parser, check_tool_call_parser
from .kinds import kind_named
from .media import AudioLimits, VideoLimits

__all__ = [
    "PER_MODEL_SETTINGS",
    "AudioLimits",
    "ImageLimits",
    "ModelSettings",
    "ServerConfig",
    "SettingError",
    "VideoLimits",
    "machine_memory",
]


@dataclass(frozen=True)
class ImageLimits:
    """Limits on the images of one request."""

    max_images: int = setting(8, at_least(1))
    """images per request, over all messages"""
    max_bytes: int = setting(10 * 1024 * 1024, at_least(1), flag="--max-image-bytes")
    """bytes per image file (after base64 decoding, or as fetched)"""
    max_pixels: int = setting(4096 * 4096, at_least(1), flag="--max-image-pixels")
    """width × height per image, read from the file header"""

    def __post_init__(self) -> None:
        check_fields(self)


_ONE = at_least(1)
_LENGTH = duration(positive=True, finite=True)
_LIMIT = duration(positive=True, optional=True)  # None: no limit
_SHARED = "of the machine's memory, shared out among the models"
_DETECTED = "detected from the chat template"
_LEFT = "of the machine's memory, less the weights and the caches' budgets"


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server, each checked as the config is made (a bad one
    is a :class:`SettingError` that names it). ``model``: a model folder or
    hub id, or a tuple of them; ``model_settings``: a dict per model of the
    settings it sets for itself."""

    model: str | tuple[str, ...] = ""
    served_model_name: str | tuple[str, ...] | None = setting(
        None, parse=str, repeated=True, shown="`MODEL` as given"
    )
    """the `model` value requests send for that model; any other is a 404. With
    several models, once per `MODEL`, in the same order, or not at all"""
    max_tokens_limit: int | None = setting(
        None, at_least(1, optional=True), shown="none"
    )
    """the largest `max_tokens` a request may ask for (`max_completion_tokens`,
    `max_output_tokens`, `num_predict` too); more is a 400. Without it, a request
    may ask any number: its answer stops with `length` where the model's context
    is full"""
    default_max_tokens: int = setting(512, _ONE)
    """`max_tokens` of a request that sets none (capped at the limit)"""
    max_pending: int = setting(256, _ONE, scope="model")
    """requests that may wait for the model; past it, 503 with `Retry-After`"""
    max_num_seqs: int = setting(32, _ONE, scope="model")
    """generations decoded together in one batch; the rest wait. `1`: one at a time"""
    max_body_bytes: int = setting(20 * 1024 * 1024, _ONE)
    """largest request body; more is a 413 (sent once up to 4 times the limit is
    read, so that clients that write their whole body first read it)"""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    api_key: str | None = setting(None, given("a key"), env="MLX_PINNED_API_KEY")
    """require `Authorization: Bearer KEY` on every route but the probes `/health`
    and `/livez`"""
    allowed_origins: tuple[str, ...] = setting((), parse=origins, shown="none")
    """comma-separated origins whose browser pages may call the API (CORS), or `*`
    for any: preflights are answered without the API key"""
    allow_remote_images: bool = setting(False)
    """fetch `http(s)://` image and video URLs, from public addresses only
    ([security](security.md))"""
    remote_image_timeout: float = setting(10.0, _LIMIT)
    """seconds to fetch one remote image or video, redirects included"""
    max_videos: int = setting(VideoLimits.max_videos, _ONE)
    """videos per request, over all messages ([video](#video))"""
    max_video_bytes: int = setting(VideoLimits.max_bytes, _ONE)
    """bytes per video file (after base64 decoding, or as fetched)"""
    max_video_seconds: float = setting(VideoLimits.max_seconds, _LENGTH)
    """length per video, from its header: a longer one is refused undecoded"""
    max_video_pixels: int = setting(VideoLimits.max_pixels, _ONE)
    """width × height per frame, from the header"""
    video_fps: float = setting(VideoLimits.fps, _LENGTH)
    """frames sampled per second of video where a request sets no `video_fps`"""
    max_video_frames: int = setting(VideoLimits.max_frames, at_least(2))
    """most frames sampled per video (a request's `video_max_frames` at most)"""
    max_audios: int = setting(AudioLimits.max_audios, _ONE)
    """audio files (`input_audio` parts) per chat request, over all messages"""
    max_audio_bytes: int = setting(AudioLimits.max_bytes, _ONE)
    """bytes per audio file"""
    max_audio_seconds: float = setting(AudioLimits.max_seconds, _LENGTH)
    """length per audio file, from its header: a longer one is refused undecoded"""
    max_prompt_tokens: int | None = setting(
        None, at_least(1, optional=True), shown="the model's context length"
    )
    """most prompt tokens, image tokens included; more is a 400
    `context_length_exceeded`"""
    request_timeout: float | None = setting(600.0, _LIMIT)
    """seconds a request may take once its body is read (images, the wait, the
    generation); past it, 504 `timeout` (an error event if the stream began).
    `0`: no limit"""
    stream_write_interval: float = setting(0.02, duration(finite=True))
    """seconds a streamed answer waits at least between two writes (the first
    token goes out at once), so tokens that come faster go out together; `0`: a
    write each time a token is in"""
    heartbeat_interval: float = setting(5.0, duration(finite=True))
    """seconds between the keep-alives of a streamed answer that waits for its
    first token (its turn, its prefill): Anthropic's `ping`, an SSE comment on
    the OpenAI doors. Its status and opening event go out once the model took
    its prompt, or this long after it was admitted
    ([first bytes](deployment.md#long-prompts-first-bytes-and-keep-alives)).
    `0`: none, the status with the first token"""
    write_timeout: float | None = setting(60.0, _LIMIT)
    """seconds a client may go without reading while its answer has more to send;
    past it its connection is closed, and its generation if it still runs. `0`:
    no limit ([slow readers](deployment.md#clients-that-read-slowly))"""
    write_buffer_bytes: int = setting(4 * 2**20, _ONE)
    """bytes of an answer kept for a client that reads slower than it is made;
    past it, its connection is closed. In all, the answers keep at most this
    times the models' `--max-num-seqs`: past that the one that keeps the most is
    closed"""
    load_wait: float | None = setting(120.0, duration(optional=True), parse=seconds)
    """seconds a request waits for its model's load, then 503 `model_not_loaded`;
    `0`: the 503 at once ([replicas](deployment.md#replicas-behind-a-balancer))"""
    unready_seconds: float = setting(0.0, duration(finite=True))
    """the first phase of a stop: seconds `serve` keeps serving after SIGTERM with
    `/health` answering 503, before its listener closes, so that balancers stop
    sending first; a second signal ends the wait"""
    in_flight_timeout: float = setting(30.0, duration(finite=True))
    """the second phase: seconds the requests in flight get to finish once the
    listener is closed; then each ends with its API's error
    ([stopping](deployment.md#stopping-sigterm-and-drain))"""
    retry_after: int = setting(1, _ONE)
    """seconds in the `Retry-After` header of every 503 that asks a client to come
    back (a full waiting room, a busy MLX thread)"""
    prompt_cache_bytes: int | None = setting(
        None, at_least(0, optional=True), scope="model", shown=f"an eighth {_SHARED}"
    )
    """bytes of prompt KV kept for requests that start alike (a chat's next turn);
    `0`: off"""
    image_cache_bytes: int | None = setting(
        None, at_least(0, optional=True), scope="model", shown=f"a 32nd {_SHARED}"
    )
    """bytes of vision-tower outputs kept for images sent again; `0`: off"""
    mlx_cache_bytes: int | None = setting(
        None, at_least(0, optional=True), shown="an eighth of memory, or MLX's limit"
    )
    """bytes of freed buffers MLX keeps for reuse (its buffer cache, emptied when a
    batch ends), at most MLX's own limit; `0`: none"""
    prefill_step_size: int = setting(2048, _ONE, scope="model")
    """prompt tokens prefilled in one pass, at most"""
    prefill_step_seconds: float | None = setting(0.25, _LIMIT, scope="model")
    """while other streams decode, a long prompt's prefill pass is sized to take
    about this long, from the model's measured cost per token (a tensor-parallel
    group cuts by tokens); `0`: passes of `--prefill-step-size` tokens
    ([engine](engine.md#a-long-prompts-chunks-by-time---prefill-step-seconds))"""
    prefill_checkpoint_tokens: int = setting(2048, at_least(0), scope="model")
    """a model whose layers keep more than KV (a sliding window, a recurrent
    state) checkpoints a long prompt's prefill every so many tokens, for the
    prompts that share its start; `0`: only at each prompt's and answer's end
    ([checkpoints](caching.md#checkpoints-sliding-window-and-recurrent-layers))"""
    abandoned_prefill_tokens: int = setting(32768, at_least(0), scope="model")
    """a prompt whose client leaves while it is prefilled, with at most this many
    tokens left, is prefilled to its end at the lowest priority into the prompt
    cache, for a retry; `0`: it stops
    ([prefill scheduling](engine.md#prefill-scheduling))"""
    tool_call_parser: str | None = setting(
        None, parser(check_tool_call_parser), scope="model", shown=_DETECTED
    )
    """the format the model writes tool calls in (`hermes`), or `none`: a request
    with tools is then a 400 ([output formats](#output-formats))"""
    reasoning_parser: str | None = setting(
        None, parser(check_reasoning_parser), scope="model", shown=_DETECTED
    )
    """the format the model writes its reasoning in (`think`), or `none`: the
    reasoning stays in `content`"""
    model_kind: str = setting("chat", scope="model")
    """what the model is served as, and so its routes: `chat`, `embedding`
    ([embeddings](embeddings.md)), `rerank`, `transcription` ([audio](audio.md))
    or `speech` ([text to speech](speech.md))"""
    load_on_first_use: bool = setting(False, scope="model")
    """load each model when its first request arrives, not at start-up
    ([on first use](#loading-on-first-use-idle-unload-a-memory-budget))"""
    idle_unload_timeout: float | None = setting(None, scope="model", shown="never")
    """seconds a model loaded on first use may sit idle before it is unloaded (its
    next request loads it again); `0`: never. Needs `--load-on-first-use`"""
    pinned: bool = setting(False, scope="model")
    """never unload the model on its own: not when idle, nor for an Ollama
    request's `keep_alive`, nor to make room under `--max-model-bytes`; only an
    unload by API does ([lifecycle](ollama.md#loading-and-unloading-by-api))"""
    max_model_bytes: int | None = setting(
        None, at_least(1, optional=True), shown="no limit"
    )
    """bytes of model weights loaded at once, over all models: a load past it
    unloads the idle models loaded on first use, least recently used first, else
    is a 503; models loaded at start-up past it fail the start-up"""
    max_kv_bytes: int | None = setting(
        None, at_least(0, optional=True), shown=f"three quarters {_LEFT}"
    )
    """bytes the requests in flight may hold, over all models (their KV and media,
    charged at admission): past it a request waits, one that never fits is a 400
    ([memory](deployment.md#memory)). `0`: no limit"""
    distributed: str | None = setting(None, one_of("tensor", optional=True))
    """`tensor`: split the model over the ranks of an `mx.distributed` group, each
    running the same command; rank 0 serves ([tensor parallelism](distributed.md))"""
    distributed_timeout: float = setting(30.0, _LENGTH)
    """seconds a rank may take to answer (a step, a collective) before the group
    counts as lost and every rank exits 1"""
    responses_store_max: int = setting(1000, at_least(0))
    """responses kept for `GET /v1/responses/{id}` and `previous_response_id`,
    oldest out first; `0`: none"""
    responses_store_bytes: int = setting(256 * 1024 * 1024, at_least(0))
    """bytes the kept responses may take (their JSON, input and conversation),
    oldest out first"""
    state_dir: str | None = setting(None, shown="none (memory only)")
    """a folder for what a restart keeps: the stored responses
    ([responses](responses.md#the-store)) and the prompt and image caches' files
    ([caching](caching.md#the-prompt-caches-disk-tier---state-dir)); made if
    missing. With `--distributed`, only with `--prompt-cache-disk-bytes 0`"""
    prompt_cache_disk_bytes: int = setting(4 * 2**30, at_least(0))
    """bytes of prompt KV and image files each model keeps under `--state-dir`,
    least recently used out first; `0`: no disk tier"""
    freeze_gc: bool = setting(False, cli=True)
    """after the model load, freeze the objects alive out of later garbage
    collections (`gc.freeze`); process-wide, so off in `create_app`"""
    playground: bool = setting(True)
    """serve the chat page at `/` ([playground](#playground))"""
    kv_bits: int | None = setting(None, one_of(4, 8, optional=True), scope="model")
    """quantize the KV cache to `4` or `8` bits per value
    ([engine](engine.md#the-quantized-kv-cache---kv-bits)); a model with
    sliding-window or recurrent layers, or heads no group divides, fails its
    load. Not with `--distributed`"""
    kv_group_size: int = setting(64, one_of(32, 64, 128), scope="model")
    """values of a head that share one scale and bias under `--kv-bits`"""
    prompt_lookup_tokens: int = setting(0, at_least(0), scope="model")
    """speculative decoding by prompt lookup: each row drafts the tokens that
    followed the latest earlier match of its last N tokens, and the batch verifies
    them in its forward pass ([engine](engine.md#speculative-decoding-prompt-lookup));
    `0`: off. Not with `--draft-model` nor `--distributed`"""
    num_draft_tokens: int = setting(3, _ONE, scope="model")
    """draft tokens per row and step, at most"""
    draft_model: str | None = setting(None, given("a folder or hub id"), scope="model")
    """speculative decoding with a small model with the served model's tokenizer
    (a folder or hub id), loaded with it
    ([engine](engine.md#a-draft-model---draft-model)), or with an mlx-vlm
    drafter made for it, such as Gemma 4's assistant
    ([engine](engine.md#native-drafters)). Not with `--distributed`"""
    mtp: bool = setting(True, scope="model")
    """draft with the multi-token prediction (MTP) layers the model's checkpoint
    carries (Qwen3.5), where it has them and neither `--prompt-lookup-tokens`
    nor `--draft-model` is given ([engine](engine.md#native-drafters)); never
    with `--distributed`"""
    draft_max_batch: int = setting(2, at_least(0), scope="model")
    """speculative steps run only while the batch holds at most this many rows;
    `0`: at any size"""
    model_settings: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        check_config(self)

    def for_model(self, index: int) -> ModelSettings:
        """The settings model ``index`` is served with: the server's, its own
        on top, and only those its kind honours (a ``SettingError`` for one out
        of range or not its kind's, its ``setting`` ``model_settings``)."""
        name = self.names[index]
        own = dict(self.model_settings[index]) if self.model_settings else {}
        kind = kind_named(own.get("model_kind", self.model_kind))
        ignored = sorted(item for item in PER_MODEL_SETTINGS if not kind.honours(item))
        refused = [item for item in ignored if item in own]
        if refused:
            raise SettingError(
                "model_settings",
                f"model {name!r}: {refused[0]} is not a setting of {kind.what}",
            )
        own.update((item, _DEFAULTS[item]) for item in ignored)
        own.setdefault("prompt_cache_bytes", self.prompt_cache_budget)
        own.setdefault("image_cache_bytes", self.image_cache_budget)
        if not own.get("load_on_first_use", self.load_on_first_use):
            own.setdefault("idle_unload_timeout", None)
        try:
            one = dataclasses.replace(
                self,
                model=self.models[index],
                served_model_name=name,
                model_settings=(),
                **own,
            )
        except ValueError as exc:
            raise SettingError("model_settings", f"model {name!r}: {exc}") from None
        disk = None
        if one.state_dir is not None and one.prompt_cache_disk_bytes > 0:
            disk = Path(one.state_dir) / "prompt_cache"
        return ModelSettings(
            name=name,
            path=one.models[0],
            kind=one.model_kind,
            prompt_cache_bytes=one.prompt_cache_budget,
            image_cache_bytes=one.image_cache_budget,
            prompt_cache_dir=disk,
            **{item: getattr(one, item) for item in _SERVERS},
        )

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model,) if isinstance(self.model, str) else self.model

    @property
    def names(self) -> tuple[str, ...]:
        """Each model's ``served_model_name``, else the model as given."""
        names = self.served_model_name or self.models
        return (names,) if isinstance(names, str) else names

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def prompt_cache_budget(self) -> int:
        return _or(self.prompt_cache_bytes, machine_memory() // 8 // len(self.models))

    @property
    def image_cache_budget(self) -> int:
        return _or(self.image_cache_bytes, machine_memory() // 32 // len(self.models))

    @property
    def mlx_cache_budget(self) -> int:
        """The buffer cache's bytes (unset: MLX's own limit, if smaller, wins)."""
        return _or(self.mlx_cache_bytes, machine_memory() // 8)

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(
            max_videos=self.max_videos,
            max_bytes=self.max_video_bytes,
            max_seconds=self.max_video_seconds,
            max_pixels=self.max_video_pixels,
            fps=self.video_fps,
            max_frames=self.max_video_frames,
        )

    @property
    def audio_limits(self) -> AudioLimits:
        return AudioLimits(
            max_bytes=self.max_audio_bytes,
            max_seconds=self.max_audio_seconds,
            max_audios=self.max_audios,
        )

    @property
    def thread_bound(self) -> int:
        """The MLX thread's queue bound: each model's waiting room and batch."""
        each = map(self.for_model, range(len(self.models)))
        return sum(own.max_pending + own.max_num_seqs for own in each)


@dataclass(frozen=True)
class ModelSettings:
    """One model's settings (:meth:`ServerConfig.for_model`), as the config's
    fields; ``kind``: its ``model_kind``; ``prompt_cache_dir``: its disk tier."""

    name: str
    path: str
    kind: str
    max_num_seqs: int
    max_pending: int
    retry_after: int
    load_on_first_use: bool
    idle_unload_timeout: float | None
    pinned: bool
    prompt_cache_bytes: int
    image_cache_bytes: int
    prefill_step_size: int
    prefill_step_seconds: float | None
    prefill_checkpoint_tokens: int
    abandoned_prefill_tokens: int
    tool_call_parser: str | None
    reasoning_parser: str | None
    kv_bits: int | None
    kv_group_size: int
    prompt_lookup_tokens: int
    num_draft_tokens: int
    draft_model: str | None
    mtp: bool
    draft_max_batch: int
    prompt_cache_dir: Path | None
    prompt_cache_disk_bytes: int
    distributed: str | None

    @classmethod
    def of(cls, model: str | os.PathLike[str], **settings: Any) -> ModelSettings:
        """The settings of ``model`` served alone with ``settings``."""
        return ServerConfig(model=os.fspath(model), **settings).for_model(0)


_DEFAULTS = {item.name: item.default for item, _ in declared(ServerConfig)}
PER_MODEL_SETTINGS = frozenset(
    item.name for item, each in declared(ServerConfig) if each.per_model
)
# What for_model resolves; ModelSettings' other fields are the config's.
_RESOLVED = ("name", "path", "kind", "prompt_cache_bytes", "image_cache_bytes")
_SERVERS = tuple(
    item.name
    for item in dataclasses.fields(ModelSettings)
    if item.name not in (*_RESOLVED, "prompt_cache_dir")
)


def _or(given: int | None, default: int) -> int:
    return default if given is None else given


def machine_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not POSIX
        return 8 * 2**30
