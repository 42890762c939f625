"""A speech-to-text model's engine: a model loaded with mlx-audio's loader,
each file transcribed a 30-second window at a time on the MLX thread.

:meth:`TranscriptionEngine.load` and every window run on the MLX thread;
:meth:`TranscriptionEngine.transcribe` is called on the event loop. A
window is one job of the thread, so a chat stream beside a long file waits
at most one window's decode between two of its steps, and a client that
goes away stops the file before its next window. Each window is decoded by
mlx-audio's own ``generate`` (its language detection, its timestamp rules,
its temperature fallback), given the text so far as its prompt, as
Whisper conditions a window on the one before. The fallback's sampling is
seeded from the audio's content and the window's place, so the same file
gives the same transcript.

The families are mlx-audio's Whisper and those of its speech-to-text models
whose ``generate`` takes a waveform and gives segments the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import mlx.core as mx
import numpy as np

from ..transcripts import Segment, TranscriptionParams, Window, Word
from .passes import kv_free_counters

if TYPE_CHECKING:
    from mlx_pinned import MLXThread

    from ..events import EngineCounters

__all__ = ["WINDOW_SECONDS", "TranscriptionEngine"]

logger = logging.getLogger("mlx_pinned.server")

#: A window: what Whisper's encoder takes at once.
WINDOW_SECONDS: Final = 30
#: OpenAI's fallback temperatures, where a request asks for 0.
FALLBACK: Final = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(eq=False)
class _Loaded:
    model: Any
    path: str
    sample_rate: int
    languages: dict[str, str]
    weight_bytes: int
    loaded_at: float = field(default_factory=time.time)


class TranscriptionEngine:
    """One speech-to-text model's engine: the
    :class:`~..transcripts.TranscriptionEngine` the HTTP side uses."""

    def __init__(self, loaded: _Loaded, thread: MLXThread) -> None:
        self.loaded = loaded
        self.thread = thread
        self.active = 0
        self.windows = 0

    @classmethod
    def load(cls, model_path: str | Path, thread: MLXThread) -> TranscriptionEngine:
        """Load a model with mlx-audio's speech-to-text loader and evaluate
        it whole; runs on ``thread``.

        Raises:
            ValueError: mlx-audio has no speech-to-text model of its family,
                or it is not one that transcribes a waveform into segments.
        """
        from mlx.utils import tree_flatten
        from mlx_audio.stt.utils import load_model

        model = load_model(str(model_path))
        if not callable(getattr(model, "generate", None)):
            raise ValueError(f"{model_path} is not a speech-to-text model")
        flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
        loaded = _Loaded(
            model=model,
            path=str(model_path),
            sample_rate=int(getattr(model, "sample_rate", 16000)),
            languages=_languages(model),
            weight_bytes=sum(value.nbytes for _, value in flat),
        )
        logger.info(
            "loaded transcription model %s: %d language(s)",
            model_path,
            len(loaded.languages),
        )
        return cls(loaded, thread)

    @property
    def sample_rate(self) -> int:
        return self.loaded.sample_rate

    @property
    def languages(self) -> dict[str, str]:
        return self.loaded.languages

    @property
    def loaded_at(self) -> float:
        return self.loaded.loaded_at

    @property
    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes

    def counters(self) -> EngineCounters:
        """Files being transcribed as its rows, windows as its steps; it
        holds no KV between windows. Any thread."""
        return kv_free_counters(self.active, self.windows)

    async def transcribe(self, params: TranscriptionParams) -> AsyncGenerator[Window]:
        """See :meth:`~..transcripts.TranscriptionEngine.transcribe`."""
        audio = params.audio
        step = WINDOW_SECONDS * audio.sample_rate
        seed = int(audio.digest[:8], 16)
        language = params.language
        text = params.prompt or ""
        first = 0
        self.active += 1
        try:
            for index, start in enumerate(range(0, len(audio.samples), step)):
                window = await self.thread.run(
                    self._window,
                    audio.samples[start : start + step],
                    params,
                    language=language,
                    prompt=text.strip() or None,
                    offset=start / audio.sample_rate,
                    first=first,
                    seed=seed + index,
                )
                self.windows += 1
                language, first = window.language, first + len(window.segments)
                text += window.text
                yield window
        finally:
            self.active -= 1

    def _window(
        self,
        samples: np.ndarray[Any, Any],
        params: TranscriptionParams,
        *,
        language: str | None,
        prompt: str | None,
        offset: float,
        first: int,
        seed: int,
    ) -> Window:
        """Decode one window with mlx-audio's ``generate``. MLX thread."""
        mx.random.seed(seed)
        temperature = FALLBACK if params.temperature == 0 else params.temperature
        result = self.loaded.model.generate(
            mx.array(samples),
            task=params.task,
            language=language,
            temperature=temperature,
            initial_prompt=prompt,
            word_timestamps=params.words,
            verbose=None,
        )
        frames = round(offset * 100)  # Whisper's seek is in 10 ms mel frames
        segments = tuple(
            _segment(raw, first + index, offset, frames)
            for index, raw in enumerate(result.segments or ())
        )
        return Window(
            text="".join(segment.text for segment in segments),
            segments=segments,
            language=str(result.language or language or "en"),
            end=offset + len(samples) / self.loaded.sample_rate,
        )


def _segment(raw: dict[str, Any], index: int, offset: float, frames: int) -> Segment:
    """One of mlx-audio's segment dicts, moved to its place in the file."""
    words = tuple(
        Word(
            word=str(word["word"]),
            start=round(float(word["start"]) + offset, 2),
            end=round(float(word["end"]) + offset, 2),
            probability=float(word.get("probability", 0.0)),
        )
        for word in raw.get("words") or ()
    )
    return Segment(
        id=index,
        seek=int(raw.get("seek", 0)) + frames,
        start=round(float(raw["start"]) + offset, 2),
        end=round(float(raw["end"]) + offset, 2),
        text=str(raw["text"]),
        tokens=tuple(int(token) for token in raw.get("tokens", ())),
        temperature=float(raw.get("temperature", 0.0)),
        avg_logprob=float(raw.get("avg_logprob", 0.0)),
        compression_ratio=float(raw.get("compression_ratio", 0.0)),
        no_speech_prob=float(raw.get("no_speech_prob", 0.0)),
        words=words,
    )


def _languages(model: Any) -> dict[str, str]:
    """The languages a Whisper model knows (its vocabulary says how many),
    by code; English alone for an English-only one or another family."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    if not getattr(model, "is_multilingual", False):
        return {"en": "english"}
    return dict(list(LANGUAGES.items())[: int(model.num_languages)])
