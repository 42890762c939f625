"""Every setting of the server: its default, its meaning and its check.

:class:`ServerConfig` declares each setting once, as a field, checked in
one place (``config_checks.py``); ``create_app`` takes a config (or the same names as
keywords). How ``mlx-pinned serve`` spells them (flags, help, config-file
keys) is the command line's own (``cli_options.py``). A plain shared module:
any thread.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .config_checks import (
    CHAT_SETTINGS,
    MODEL_KINDS,
    PER_MODEL_SETTINGS,
    SettingError,
    check_config,
    check_limits,
)

__all__ = [
    "CHAT_SETTINGS",
    "MODEL_KINDS",
    "PER_MODEL_SETTINGS",
    "AudioLimits",
    "ImageLimits",
    "ModelKind",
    "ServerConfig",
    "SettingError",
    "VideoLimits",
]


#: What a model is served as: ``chat`` (the generation routes),
#: ``embedding`` (``/v1/embeddings``), ``rerank`` (``/v1/rerank``) or
#: ``transcription`` (``/v1/audio/transcriptions`` and ``translations``) or
#: ``speech`` (``/v1/audio/speech``); one of :data:`MODEL_KINDS`.
ModelKind = Literal["chat", "embedding", "rerank", "transcription", "speech"]


# What a chat setting is for a model of another kind: off.
_CHAT_OFF: dict[str, Any] = {
    "kv_bits": None,
    "prompt_lookup_tokens": 0,
    "draft_model": None,
    "tool_call_parser": None,
    "reasoning_parser": None,
}


@dataclass(frozen=True)
class ImageLimits:
    """Limits on the images of one request.

    Attributes:
        max_images: Images per request, over all messages.
        max_bytes: Encoded (base64-decoded) bytes per image.
        max_pixels: Width times height per image, read from the header.
    """

    max_images: int = 8
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        check_limits(self)


@dataclass(frozen=True)
class VideoLimits:
    """Limits on the videos of one request (:attr:`ServerConfig.video_limits`).

    Attributes:
        max_videos: Videos per request, over all messages.
        max_bytes: Encoded (base64-decoded or fetched) bytes per video.
        max_seconds: Length per video, read from its header.
        max_pixels: Width times height per frame, read from its header.
        fps: Frames sampled per second of video when a request sets no
            ``video_fps``.
        max_frames: Most frames sampled per video, and the largest
            ``video_max_frames`` a request may ask for.
    """

    max_videos: int = 2
    max_bytes: int = 16 * 1024 * 1024
    max_seconds: float = 600.0
    max_pixels: int = 1920 * 1080
    fps: float = 2.0
    max_frames: int = 32


@dataclass(frozen=True)
class AudioLimits:
    """Limits on an audio file (:attr:`ServerConfig.audio_limits`), each
    checked from the file's header before it is decoded, and its length
    again on what decoding gave.

    Attributes:
        max_bytes: Encoded bytes per file.
        max_seconds: Length per file.
        max_channels: Channels per file.
        min_sample_rate: The lowest sample rate taken (Hz).
        max_sample_rate: The highest sample rate taken (Hz).
        max_audios: Audio files per chat request, over all messages.
    """

    max_bytes: int = 20 * 1024 * 1024
    max_seconds: float = 1800.0
    max_channels: int = 8
    min_sample_rate: int = 8000
    max_sample_rate: int = 192000
    max_audios: int = 2


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server. Each is checked as the config is made, in
    one place (``config_checks.py``); a bad one is a :class:`SettingError`
    that names it. Every setting applies to each served model alike
    (``max_num_seqs`` rows and ``max_pending`` waiting requests per model).

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
        allow_remote_images: Fetch ``http(s)://`` image and video URLs (off:
            they are a 400), from public addresses only, at most
            ``image_limits.max_bytes`` per image and ``max_video_bytes`` per
            video.
        remote_image_timeout: Seconds for fetching one remote image or video.
        max_videos: Videos per request, over all messages.
        max_video_bytes: Encoded bytes per video.
        max_video_seconds: Length per video, from its header; longer is a 400
            before any frame is decoded.
        max_video_pixels: Width times height per frame, from its header.
        video_fps: Frames sampled per second of video where a request sets
            no ``video_fps``.
        max_video_frames: Most frames sampled per video (a request's
            ``video_max_frames`` may ask for fewer, not more).
        max_audios: Audio files (``input_audio`` parts) per chat request,
            over all messages.
        max_audio_bytes: Encoded bytes per audio file.
        max_audio_seconds: Length per audio file, from its header; longer
            is a 400 before it is decoded.
        max_prompt_tokens: Most prompt tokens, images included; None: the
            model's context length from its config.
        request_timeout: Seconds a request may take after its body is read
            (images, queue wait and generation); past it, 504 (or an error
            event) and the generation is closed. None: no limit.
        stream_write_interval: Seconds a streamed answer waits at least
            between two writes (the first token goes out at once): tokens
            that come faster go out together, fewer writes for the server
            and the client to make; 0: a write each time a token is in.
        load_wait: Seconds a request waits for its model's load (at start-up,
            or on first use) before a 503 ``model_not_loaded``; the
            readiness probe answers 503 meanwhile. 0: the 503 at once (behind
            a balancer that sends it to another replica); None: as long as
            the load takes.
        unready_seconds: The first phase of a stop: seconds the server
            keeps serving after SIGTERM with ``/health`` answering 503,
            before it closes its listener, so that balancers that probe
            ``/health`` stop sending first. A second signal ends the wait.
            Read by the runner of ``mlx-pinned serve``
            (:class:`~.http.uvicorn_server.Server`): an app run under another
            server has no such wait.
        in_flight_timeout: The second phase: seconds the requests in
            flight get to finish once the listener is closed, before the
            MLX thread stops.
        retry_after: Seconds sent in ``Retry-After`` with every 503 that
            asks the client to come back (a full waiting room, a busy thread).
        prefill_step_size: Prompt tokens prefilled in one pass, at most.
        prefill_step_seconds: Seconds a pass of a long prompt's prefill
            takes, about, while other rows decode and wait for it: its
            tokens are sized from the model's measured cost per token
            (``engine/pacing.py``). None: passes of ``prefill_step_size``.
            A tensor-parallel group cuts by tokens (every rank alike).
        tool_call_parser: The format each model writes tool calls in, by
            name (``mlx_pinned.server.formats``), or ``"none"``: a request
            with tools is then a 400. None: the format its chat template
            shows, if any.
        reasoning_parser: The format each model writes its reasoning in, by
            name, or ``"none"``: the reasoning stays in the content. None:
            the format its chat template shows, if any.
        model_kind: What each model is served as (:data:`ModelKind`):
            ``chat`` (mlx-vlm's generation, the chat and completion
            routes), ``embedding`` (mlx-vlm's embedding loader,
            ``/v1/embeddings``), ``rerank`` (mlx-vlm's reranker loader,
            ``/v1/rerank``), ``transcription`` (mlx-audio's speech-to-text
            loader, ``/v1/audio/transcriptions`` and
            ``/v1/audio/translations``) or ``speech`` (mlx-audio's
            text-to-speech loader, ``/v1/audio/speech``). A model of one
            kind named on another's route is a 400.
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
        responses_store_max: Responses kept for ``GET /v1/responses/{id}`` and
            ``previous_response_id`` (all models together; in memory, or
            in ``state_dir``); past
            it the oldest go first. 0: none is kept.
        responses_store_bytes: Bytes the kept responses may take (their JSON,
            input and conversation, images included); past it the oldest go
            first, and a response larger than this alone is not kept.
        state_dir: A folder for what the server keeps across restarts: the
            stored responses, in a SQLite database (``responses.sqlite3``,
            within the same bounds), and the disk tier of the prompt and
            image caches (``prompt_cache/``, within
            ``prompt_cache_disk_bytes``). Made if
            missing; one that cannot hold the store (not a folder, not
            writable, a corrupt or foreign database, in use by another
            server) fails the start. None: memory only.
        prompt_cache_disk_bytes: Bytes of prompt KV and image files each
            model may keep under ``state_dir`` (every prompt cache entry,
            and every image the image cache holds, is written there; a
            lookup that finds a longer prefix there than in memory, or an
            image not held, loads it); 0: no disk tier. Without
            ``state_dir``, unused.
        mlx_cache_bytes: The most bytes of freed buffers MLX keeps for reuse
            (its buffer cache, process-wide, emptied whenever a batch ends);
            0: none kept. None: MLX's own limit or an eighth of the
            machine's memory, whichever is smaller (Metal's own is the whole
            working set: a Mac that is also a desktop would lend it all).
        freeze_gc: After the model is loaded, collect garbage once and move
            every object left to the collector's permanent generation
            (:func:`gc.freeze`), so later full collections skip the
            libraries and the model, during which nothing on the event loop
            or the MLX thread runs. Process-wide, so off by default.
        playground: Serve the chat page at ``/`` (and its assets under
            ``/playground/``); off: those paths are 404.
        kv_bits: Quantize the KV cache to 4 or 8 bits per value (mlx-vlm's
            quantized caches, as ``mx.quantize`` packs them); None: keep it
            in the model's float type. A model whose cache cannot be
            quantized (sliding-window or recurrent layers) fails its load.
        kv_group_size: Values of a head that share one scale and bias
            under ``kv_bits``: 32, 64 or 128, dividing the model's head size.
        prompt_lookup_tokens: Speculative decoding by prompt lookup: each
            row drafts the tokens that followed the latest earlier
            occurrence of its last n tokens (n from this down to 1) in its
            prompt and answer, and the batch verifies every row's drafts
            in one forward pass; 0: off. Needs a model whose KV cache can
            be cut back (docs/engine.md).
        num_draft_tokens: Draft tokens per row and step, at most (mlx-lm's
            name).
        draft_model: Speculative decoding with a draft model: a small
            model with the served model's tokenizer (a folder or a hub id)
            drafts each row's next tokens greedily, verified as prompt
            lookup's are; None: off. Not with ``prompt_lookup_tokens``.
        draft_max_batch: Speculative steps run only while the batch holds
            at most this many rows (a verify pass computes every row's
            drafts; a larger batch is bound by that compute, and drafts
            cost it more than they give); 0: at any size.
    """

    model: str | tuple[str, ...] = ""
    served_model_name: str | tuple[str, ...] | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int = 512
    max_pending: int = 256
    max_num_seqs: int = 32
    max_body_bytes: int = 20 * 1024 * 1024
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allow_remote_images: bool = False
    remote_image_timeout: float = 10.0
    max_videos: int = 2
    max_video_bytes: int = 16 * 1024 * 1024
    max_video_seconds: float = 600.0
    max_video_pixels: int = 1920 * 1080
    video_fps: float = 2.0
    max_video_frames: int = 32
    max_audios: int = 2
    max_audio_bytes: int = 20 * 1024 * 1024
    max_audio_seconds: float = 1800.0
    max_prompt_tokens: int | None = None
    request_timeout: float | None = 600.0
    stream_write_interval: float = 0.02
    load_wait: float | None = 120.0
    unready_seconds: float = 0.0
    in_flight_timeout: float = 30.0
    retry_after: int = 1
    prompt_cache_bytes: int | None = None
    image_cache_bytes: int | None = None
    mlx_cache_bytes: int | None = None
    prefill_step_size: int = 2048
    prefill_step_seconds: float | None = 0.25
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    model_kind: ModelKind = "chat"
    load_on_first_use: bool = False
    idle_unload_timeout: float | None = None
    max_model_bytes: int | None = None
    distributed: str | None = None
    distributed_timeout: float = 30.0
    responses_store_max: int = 1000
    responses_store_bytes: int = 256 * 1024 * 1024
    state_dir: str | None = None
    prompt_cache_disk_bytes: int = 4 * 2**30
    # Process-wide: a library user's app shares the process with other code.
    freeze_gc: bool = False
    playground: bool = True
    # The quantized KV cache.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # Speculative decoding (engine/drafting.py).
    prompt_lookup_tokens: int = 0
    num_draft_tokens: int = 3
    draft_model: str | None = None
    draft_max_batch: int = 2
    model_settings: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        check_config(self)

    def for_model(self, index: int) -> ServerConfig:
        """The settings model ``index`` (in :attr:`models`) is served with:
        the server's, with its own :attr:`model_settings` on top, as a config
        of that one model. The default cache budgets stay shared out among
        all the models; a server-wide ``idle_unload_timeout`` applies to it
        only if it is loaded on first use; the server's chat settings
        (:data:`CHAT_SETTINGS`: the KV cache, drafts, output formats) do not
        apply to a model of another kind.

        Raises:
            SettingError: Its own settings are out of range, or chat
                settings of a model of another kind (the message names the
                model and the field; :attr:`~SettingError.setting` is
                ``model_settings``).
        """
        own = dict(self.model_settings[index]) if self.model_settings else {}
        if own.get("model_kind", self.model_kind) != "chat":
            given = sorted(set(own) & CHAT_SETTINGS)
            if given:
                raise SettingError(
                    "model_settings",
                    f"model {self.names[index]!r}: {given[0]} is a chat model's "
                    f"setting; this model is served as {own.get('model_kind')!r}",
                )
            own.update((name, _CHAT_OFF[name]) for name in CHAT_SETTINGS)
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
            raise SettingError(
                "model_settings", f"model {self.names[index]!r}: {exc}"
            ) from None

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
    def video_limits(self) -> VideoLimits:
        """The video settings, as the video decoder takes them."""
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
        """The audio settings, as the audio decoder takes them."""
        return AudioLimits(
            max_bytes=self.max_audio_bytes,
            max_seconds=self.max_audio_seconds,
            max_audios=self.max_audios,
        )

    @property
    def mlx_cache_budget(self) -> int:
        """The buffer cache's most bytes (MLX's own limit, if smaller, wins
        when unset: :func:`~.engine.memory.limit_buffer_cache`)."""
        if self.mlx_cache_bytes is not None:
            return self.mlx_cache_bytes
        return _memory() // 8

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


def _memory() -> int:
    """The machine's memory in bytes (8 GiB where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not POSIX
        return 8 * 2**30
