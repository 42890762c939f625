"""A speech-to-text model's engine: mlx-audio's Whisper or Parakeet, each
file decoded by its ``generate`` a 30-second window at a time, one job of
the MLX thread each. Loading and every window run on the MLX thread;
:meth:`TranscriptionEngine.transcribe` is called on the event loop."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

import mlx.core as mx
import numpy as np

from ...engine.passes import Holding, kv_free_counters
from .values import Segment, TranscriptionFacts, TranscriptionParams, Window, Word

if TYPE_CHECKING:
    from mlx_pinned import MLXThread

    from ...config import ModelSettings
    from ...resident import EngineCounters

__all__ = ["WINDOW_SECONDS", "TranscriptionEngine"]

logger = logging.getLogger("mlx_pinned.server")

#: A window: what Whisper's encoder takes at once.
WINDOW_SECONDS: Final = 30
#: OpenAI's fallback temperatures, where a request asks for 0.
FALLBACK: Final = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
#: What a request may ask of Whisper beside the file; Parakeet (greedy,
#: English, no prompt) takes word timestamps only.
WHISPER_OPTIONS: Final = frozenset({"language", "prompt", "temperature", "words"})
ALIGNED_OPTIONS: Final = frozenset({"words"})


@dataclass(eq=False)
class _Loaded:
    model: Any
    path: str
    sample_rate: int
    languages: dict[str, str]
    whisper: bool
    weight_bytes: int
    loaded_at: float = field(default_factory=time.time)


class TranscriptionEngine(Holding[_Loaded]):
    """One model's :class:`~.values.TranscriptionEngine`."""

    def __init__(self, loaded: _Loaded, thread: MLXThread) -> None:
        self.loaded = loaded
        self.thread = thread
        options = WHISPER_OPTIONS if loaded.whisper else ALIGNED_OPTIONS
        self.facts = TranscriptionFacts(loaded.sample_rate, options, loaded.languages)
        self.active = 0
        self.windows = 0

    @classmethod
    def load(cls, settings: ModelSettings, thread: MLXThread) -> TranscriptionEngine:
        """Load a Whisper or Parakeet model with mlx-audio's loader. MLX thread."""
        from mlx.utils import tree_flatten
        from mlx_audio.stt.utils import load_model

        model = load_model(settings.path)
        whisper = hasattr(model, "detect_language")
        if not whisper and not hasattr(model, "decode_chunk"):
            raise ValueError(
                f"{settings.path} is a speech-to-text model of a family this server "
                "does not transcribe with yet (it serves Whisper and Parakeet)"
            )
        flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
        loaded = _Loaded(
            model=model,
            path=settings.path,
            sample_rate=_sample_rate(model),
            languages=_languages(model),
            whisper=whisper,
            weight_bytes=sum(value.nbytes for _, value in flat),
        )
        logger.info(
            "loaded transcription model %s: %d language(s)",
            settings.path,
            len(loaded.languages),
        )
        return cls(loaded, thread)

    def counters(self) -> EngineCounters:
        """Files being transcribed as its rows, windows as its steps; it
        holds no KV between windows. Any thread."""
        return kv_free_counters(self.active, self.windows)

    async def transcribe(self, params: TranscriptionParams) -> AsyncGenerator[Window]:
        """See :meth:`.values.TranscriptionEngine.transcribe`; each window is
        given the text so far as its prompt, and its fallback's sampling is
        seeded from the audio and the window's place, so a file gives the
        same transcript."""
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
        model = self.loaded.model
        if self.loaded.whisper:
            mx.random.seed(seed)
            temperature = FALLBACK if params.temperature == 0 else params.temperature
            result = model.generate(
                mx.array(samples),
                task=params.task,
                language=language,
                temperature=temperature,
                initial_prompt=prompt,
                word_timestamps=params.words,
                verbose=None,
            )
            raws = result.segments or []
            language = result.language or language
        else:  # an aligned-token family (Parakeet): greedy, in English
            result = model.generate(mx.array(samples))
            raws = [_aligned(sentence) for sentence in result.sentences]
        frames = round(offset * 100)  # Whisper's seek is in 10 ms mel frames
        segments = tuple(
            _segment(raw, first + index, offset, frames)
            for index, raw in enumerate(raws)
        )
        return Window(
            text="".join(segment.text for segment in segments),
            segments=segments,
            language=str(language or "en"),
            end=offset + len(samples) / self.loaded.sample_rate,
        )


def _segment(raw: dict[str, Any], index: int, offset: float, frames: int) -> Segment:
    """One of mlx-audio's segment dicts, moved to its place in the file."""
    words = tuple(
        Word(
            word=str(word["word"]),
            start=round(float(word["start"]) + offset, 2),
            end=round(float(word["end"]) + offset, 2),
            probability=_number(word.get("probability")),
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
        temperature=_number(raw.get("temperature")),
        avg_logprob=_number(raw.get("avg_logprob")),
        compression_ratio=_number(raw.get("compression_ratio")),
        no_speech_prob=_number(raw.get("no_speech_prob")),
        words=words,
    )


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _aligned(sentence: Any) -> dict[str, Any]:
    """An aligned sentence of mlx-audio's (Parakeet's tokens with their
    times) as a segment of Whisper's shape, its words the tokens joined
    where a token starts a word (a space first); no decoding statistics."""
    words: list[dict[str, Any]] = []
    for token in sentence.tokens:
        if not words or token.text.startswith(" "):
            words.append({"word": "", "start": token.start, "probability": None})
        words[-1]["word"] += token.text
        words[-1]["end"] = token.end
    return {
        "start": sentence.start,
        "end": sentence.end,
        "text": sentence.text,
        "tokens": [token.id for token in sentence.tokens],
        "words": words,
    }


def _sample_rate(model: Any) -> int:
    """The rate a model takes: Whisper's 16 kHz, or its preprocessor's."""
    preprocessor = getattr(model, "preprocessor_config", None)
    return int(getattr(preprocessor, "sample_rate", 16000))


def _languages(model: Any) -> dict[str, str]:
    """The languages a Whisper model knows (its vocabulary says how many),
    by code; English alone for an English-only one or another family."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    if not getattr(model, "is_multilingual", False):
        return {"en": "english"}
    return dict(list(LANGUAGES.items())[: int(model.num_languages)])
