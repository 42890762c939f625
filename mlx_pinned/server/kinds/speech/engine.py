"""A text-to-speech model's engine: mlx-audio's loader and streaming
generation, a stream of the MLX thread (``MLXThread.iterate``) that makes a
piece of audio per job. Loading and every piece run on the MLX thread;
:meth:`SpeechEngine.speak` is called on the event loop."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncGenerator, Generator, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import mlx.core as mx
import numpy as np

from ...engine.passes import Holding, kv_free_counters
from .values import SpeechChunk, SpeechFacts, SpeechParams

if TYPE_CHECKING:
    from mlx_pinned import MLXThread

    from ...config import ModelSettings
    from ...resident import EngineCounters

__all__ = [
    "CHUNK_FRAMES",
    "LoadedSpeaker",
    "SpeechEngine",
    "frame_limit",
    "load_speaker",
    "to_pcm16",
]

logger = logging.getLogger("mlx_pinned.server")

#: Audio frames a piece is made of: a piece is a job of the MLX thread, so
#: this bounds how long a speech holds the thread between other work.
CHUNK_FRAMES: Final = 4

#: Frames a second of Qwen3-TTS's speech tokenizer (its "12Hz" codec).
FRAME_RATE: Final = 12.5

# Two frames a character (speech runs at about one) and two seconds more, so
# a model that never ends its speech stops within a bound of its text.
_FRAMES_PER_CHAR: Final = 2
_EXTRA_FRAMES: Final = 25


def frame_limit(text: str, model_limit: int) -> int:
    """The most audio frames ``text`` may make."""
    return min(model_limit, _FRAMES_PER_CHAR * len(text) + _EXTRA_FRAMES)


def to_pcm16(audio: np.ndarray) -> bytes:
    """Float samples (-1..1) as 16-bit little-endian PCM, clipped."""
    scaled = np.clip(audio, -1.0, 1.0) * 32767.0
    return bytes(np.rint(scaled).astype("<i2").tobytes())


@dataclass(eq=False)
class LoadedSpeaker:
    """A text-to-speech model loaded and evaluated on the MLX thread: its
    facts as :class:`~.values.SpeechFacts`, and ``max_frames``, the most
    frames one generation may make (its config's)."""

    model: Any
    path: str
    sample_rate: int
    voices: tuple[str, ...]
    takes_instructions: bool
    takes_speed: bool
    max_frames: int
    weight_bytes: int
    loaded_at: float = field(default_factory=time.time)

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` in the model's text tokenizer. MLX thread."""
        tokenizer = getattr(self.model, "tokenizer", None)
        return len(tokenizer.encode(text)) if tokenizer is not None else 0

    def pieces(
        self, params: SpeechParams
    ) -> Generator[tuple[np.ndarray, int], None, None]:
        """Each piece of ``params``'s audio as mlx-audio streams it: its float
        samples and frames. MLX thread; closing it closes mlx-audio's."""
        results = self.model.generate(
            params.text,
            voice=params.voice,
            instruct=params.instructions,
            speed=params.speed,
            stream=True,
            streaming_interval=CHUNK_FRAMES / FRAME_RATE,
            max_tokens=frame_limit(params.text, self.max_frames),
            verbose=False,
        )
        try:
            for result in results:
                audio = np.array(result.audio, dtype=np.float32, copy=True)
                yield audio.reshape(-1), int(result.token_count)
        finally:
            results.close()


def load_speaker(model_path: str | Path) -> LoadedSpeaker:
    """Load a text-to-speech model that names its voices with mlx-audio's
    loader, and evaluate it. MLX thread."""
    from mlx.utils import tree_flatten
    from mlx_audio.tts.utils import load_model

    folder = Path(model_path)
    model = load_model(folder if folder.is_dir() else cast("Any", str(model_path)))
    mx.eval(model.parameters())
    speakers: list[str] = getattr(model, "get_supported_speakers", list)()
    voices = tuple(str(voice).lower() for voice in speakers)
    if not voices:
        raise ValueError(
            f"{model_path} names no voices (a voice-cloning checkpoint); "
            "/v1/audio/speech serves models with named voices, such as "
            "Qwen3-TTS CustomVoice"
        )
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    settings = getattr(model, "generate_config", None) or {}
    loaded = LoadedSpeaker(
        model=model,
        path=str(model_path),
        sample_rate=int(model.sample_rate),
        voices=voices,
        takes_instructions=_takes_instructions(model),
        takes_speed=_takes_speed(model),
        max_frames=int(settings.get("max_new_tokens") or 2048),
        weight_bytes=sum(value.nbytes for _, value in flat),
    )
    logger.info(
        "loaded speech model %s: %d Hz, voices %s",
        model_path,
        loaded.sample_rate,
        ", ".join(voices),
    )
    return loaded


def _takes_instructions(model: Any) -> bool:
    """Whether ``model``'s ``generate`` takes ``instruct`` and heeds it
    (mlx-audio drops a 0.6B Qwen3-TTS checkpoint's instructions)."""
    if "instruct" not in inspect.signature(model.generate).parameters:
        return False
    config = getattr(model, "config", None)
    return getattr(config, "tts_model_size", "") != "0b6"


def _takes_speed(model: Any) -> bool:
    """Whether ``model``'s ``generate`` takes ``speed`` and heeds it (Qwen3-TTS
    takes one and ignores it)."""
    if "speed" not in inspect.signature(model.generate).parameters:
        return False
    return getattr(model, "model_type", "") != "qwen3_tts"


class SpeechEngine(Holding[LoadedSpeaker]):
    """One model's :class:`~.values.SpeechEngine`."""

    def __init__(self, loaded: LoadedSpeaker, thread: MLXThread) -> None:
        self.loaded = loaded
        self.thread = thread
        self.facts = SpeechFacts(
            loaded.sample_rate,
            loaded.voices,
            loaded.takes_instructions,
            loaded.takes_speed,
        )
        # Qwen3-TTS keeps its vocoder's streaming state on the model, so a
        # model speaks for one request at a time.
        self.turns = thread.exclusive(loaded.model)
        self.speaking = 0
        self.frames = 0
        self.pieces = 0

    @classmethod
    def load(cls, settings: ModelSettings, thread: MLXThread) -> SpeechEngine:
        """MLX thread."""
        return cls(load_speaker(settings.path), thread)

    def counters(self) -> EngineCounters:
        """Generations speaking as its rows, frames made as its decoded
        tokens and pieces as its steps; it holds no KV. Any thread."""
        counters = kv_free_counters(self.speaking, self.pieces)
        return dataclasses.replace(counters, decoded_tokens=self.frames)

    async def speak(self, params: SpeechParams) -> AsyncGenerator[SpeechChunk, None]:
        async with aclosing(self.turns.iterate(self._generate, params)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _generate(self, params: SpeechParams) -> Iterator[SpeechChunk]:
        """The generation, as pieces of PCM. MLX thread (a job a piece)."""
        self.speaking += 1
        try:
            tokens = self.loaded.count_tokens(params.text)
            with closing(self.loaded.pieces(params)) as pieces:
                for audio, frames in pieces:
                    self.frames += frames
                    self.pieces += 1
                    yield SpeechChunk(to_pcm16(audio), frames, tokens)
        finally:
            self.speaking -= 1
