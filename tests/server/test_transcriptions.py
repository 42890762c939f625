"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``:
OpenAI's shape through the openai SDK (each ``response_format``, streamed
deltas), the transcript mlx-audio's own ``generate`` gives for each window,
hostile files (never a 5xx), and a transcription model beside a chat model
in the one registry, never stalling its stream for long."""

from __future__ import annotations

import io
import struct
import wave
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from conftest import run_uvicorn

from mlx_pinned.server import create_app
from mlx_pinned.server.config import AudioLimits
from mlx_pinned.server.inputs.audio import decode_audio
from mlx_pinned.server.kinds.transcription.engine import FALLBACK, TranscriptionEngine
from mlx_pinned.testing import tiny_transcription_path

from .conftest import assert_error
from .kit import Lifespan, Served, chat_beside, serving_kind, slow_on_asyncio

pytestmark = pytest.mark.anyio

MODEL = "whisper"
RATE = 16000
# One temperature: one decode a window (0 would retry hotter ones while a
# window fails Whisper's checks, as a random model's always do).
WARM = 0.2

ServeWhisper = Callable[..., AbstractAsyncContextManager[Served]]


def wav(seconds: float, *, rate: int = RATE, channels: int = 1, seed: int = 0) -> bytes:
    """A WAV file of ``seconds`` of a noisy tone (16-bit PCM)."""
    rng = np.random.default_rng(seed)
    frames = int(seconds * rate)
    t = np.arange(frames) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t)
    tone += 0.05 * rng.standard_normal(frames)
    samples = np.repeat((tone * 32767).astype("<i2")[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(samples.tobytes())
    return out.getvalue()


@pytest.fixture(scope="session")
def whisper_path() -> Path:
    return tiny_transcription_path()


@pytest.fixture
def serve_whisper(whisper_path: Path, lifespan: Lifespan) -> ServeWhisper:
    """An app serving the tiny Whisper as ``whisper``, its lifespan running."""
    return serving_kind(whisper_path, "transcription", MODEL, lifespan)


def engine_of(served: Served, name: str = MODEL) -> TranscriptionEngine:
    engine = served.app.state.models.get(name).engine()
    assert isinstance(engine, TranscriptionEngine)
    return engine


async def post(
    served: Served,
    audio: bytes | None,
    path: str = "/v1/audio/transcriptions",
    *,
    brackets: bool = True,
    **fields: Any,
) -> httpx.Response:
    """A multipart upload as OpenAI's SDK sends one (lists repeated as
    ``name[]``; without ``brackets``, as OpenAI's OpenAPI document names
    them: ``name``)."""
    fields.setdefault("model", MODEL)
    data: dict[str, str | list[str]] = {}
    for name, value in fields.items():
        if isinstance(value, list):
            data[f"{name}[]" if brackets else name] = [str(v) for v in value]
        else:
            data[name] = str(value).lower() if isinstance(value, bool) else str(value)
    # A form part that is no file keeps the body multipart without one.
    file = ("file", ("speech.wav", audio, "audio/wav"))
    files = [file if audio is not None else ("stream", (None, "false"))]
    return await served.client.post(path, data=data, files=files)


async def library(served: Served, audio: bytes, **options: Any) -> list[Any]:
    """mlx-audio's own ``generate`` on each 30-second window of ``audio``,
    on the MLX thread, seeded and prompted as the engine does."""
    engine = engine_of(served)
    clip = decode_audio(audio, AudioLimits(), sample_rate=RATE)
    seed = int(clip.digest[:8], 16)
    model = engine.loaded.model
    results, text = [], ""

    def one(window: np.ndarray, index: int, prompt: str | None) -> Any:
        mx.random.seed(seed + index)
        return model.generate(mx.array(window), initial_prompt=prompt, **options)

    for index, start in enumerate(range(0, len(clip.samples), 30 * RATE)):
        window = clip.samples[start : start + 30 * RATE]
        result = await served.thread.run(one, window, index, text.strip() or None)
        results.append(result)
        text += "".join(segment["text"] for segment in result.segments)
    return results


async def test_the_openai_sdk_transcribes_a_file_as_mlx_audio_does(
    serve_whisper: ServeWhisper,
) -> None:
    audio = wav(3.0)
    async with serve_whisper() as served:
        client = served.sdk()
        plain = await client.audio.transcriptions.create(
            model=MODEL, file=("speech.wav", audio, "audio/wav"), temperature=WARM
        )
        verbose = await client.audio.transcriptions.create(
            model=MODEL,
            file=("speech.wav", audio),
            response_format="verbose_json",
            temperature=WARM,
        )
        (expected,) = await library(
            served, audio, temperature=WARM, task="transcribe", language=None
        )
    assert plain.text == expected.text.strip() != ""
    assert plain.usage is not None
    assert plain.usage.seconds == 3
    assert verbose.language == "english"
    assert verbose.duration == 3.0
    assert verbose.text == plain.text
    segments = verbose.segments or []
    assert [s.tokens for s in segments] == [s["tokens"] for s in expected.segments]
    assert [s.avg_logprob for s in segments] == pytest.approx(
        [s["avg_logprob"] for s in expected.segments], abs=1e-6
    )
    assert segments[0].start == 0.0
    assert segments[-1].end <= 3.0


@slow_on_asyncio
async def test_every_response_format(serve_whisper: ServeWhisper) -> None:
    audio = wav(2.0, seed=1)
    async with serve_whisper() as served:
        answers = {
            kind: await post(served, audio, response_format=kind, temperature=WARM)
            for kind in ("json", "text", "srt", "vtt", "verbose_json")
        }
        words = await post(
            served,
            audio,
            response_format="verbose_json",
            timestamp_granularities=["word"],
            temperature=WARM,
        )
    text = answers["json"].json()["text"]
    assert answers["json"].json()["usage"] == {"type": "duration", "seconds": 2}
    assert answers["text"].text == text + "\n"
    assert answers["text"].headers["content-type"].startswith("text/plain")
    srt = answers["srt"].text.splitlines()
    assert srt[0] == "1"
    assert srt[1].startswith("00:00:00,000 --> 00:00:0")
    assert srt[2] == text
    vtt = answers["vtt"].text.splitlines()
    assert vtt[0] == "WEBVTT"
    assert vtt[2].startswith("00:00:00.000 --> ")
    assert answers["vtt"].headers["content-type"].startswith("text/vtt")
    verbose = words.json()
    assert "segments" not in verbose  # only words were asked for
    assert verbose["words"]
    assert all(0 <= w["start"] <= w["end"] <= 2.0 for w in verbose["words"])
    assert "".join(w["word"] for w in verbose["words"]).replace(" ", "") == (
        text.replace(" ", "")
    )


@slow_on_asyncio
async def test_a_long_file_streams_each_window_as_it_is_done(
    serve_whisper: ServeWhisper,
) -> None:
    audio = wav(65.0, seed=2)
    async with serve_whisper() as served:
        client = served.sdk()
        stream = await client.audio.transcriptions.create(
            model=MODEL, file=("speech.wav", audio), stream=True, temperature=WARM
        )
        events = [event async for event in stream]
        whole = await post(
            served, audio, response_format="verbose_json", temperature=WARM
        )
        expected = await library(
            served, audio, temperature=WARM, task="transcribe", language=None
        )
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert len(deltas) == 3
    assert done.type == "transcript.text.done"
    assert "".join(d.delta for d in deltas).strip() == done.text
    answer = whole.json()
    assert done.text == answer["text"] != ""
    assert done.usage is None  # OpenAI's stream has token usage only
    # Each window is mlx-audio's own, prompted with the text before it; the
    # segments are numbered on and their times moved to the file's.
    tokens = [s["tokens"] for r in expected for s in r.segments]
    assert [s["tokens"] for s in answer["segments"]] == tokens
    assert [s["id"] for s in answer["segments"]] == list(range(len(tokens)))
    assert answer["segments"][-1]["start"] >= 60.0
    assert answer["duration"] == 65.0


@slow_on_asyncio
async def test_a_translation_is_its_own_task(serve_whisper: ServeWhisper) -> None:
    audio = wav(2.0, seed=3)
    async with serve_whisper() as served:
        translated = await post(
            served,
            audio,
            "/v1/audio/translations",
            response_format="verbose_json",
            temperature=WARM,
        )
        transcribed = await post(
            served, audio, response_format="verbose_json", temperature=WARM
        )
        (expected,) = await library(served, audio, temperature=WARM, task="translate")
        in_french = await post(served, audio, language="fr", temperature=WARM)
        no_language = await post(served, audio, "/v1/audio/translations", language="fr")
    answer = translated.json()
    assert answer["task"] == "translate"
    assert answer["language"] == "english"
    assert [s["tokens"] for s in answer["segments"]] == [
        s["tokens"] for s in expected.segments
    ]
    assert answer["segments"][0]["avg_logprob"] != pytest.approx(
        transcribed.json()["segments"][0]["avg_logprob"]
    )
    assert in_french.status_code == 200
    assert_error(no_language, 400, "language", "unknown_parameter")


@slow_on_asyncio
async def test_the_same_file_gives_the_same_transcript(
    serve_whisper: ServeWhisper,
) -> None:
    """Temperature 0 falls back to sampling (seeded by the file)."""
    audio = wav(1.0, seed=4)
    async with serve_whisper() as served:
        first = await post(served, audio, response_format="verbose_json")
        again = await post(served, audio, response_format="verbose_json")
    assert first.status_code == 200, first.text
    assert first.json()["segments"] == again.json()["segments"]
    assert first.json()["segments"][0]["temperature"] in FALLBACK


def riff(chunks: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


async def test_hostile_files_are_400s_that_name_the_file(
    serve_whisper: ServeWhisper,
) -> None:
    good = wav(1.0)
    lying = bytearray(good)
    struct.pack_into("<I", lying, 40, RATE * 2 * 7200)  # data: "two hours"
    eight_channels = wav(0.5, channels=9)
    async with serve_whisper(max_audio_seconds=5.0, max_audio_bytes=400_000) as served:
        answers = {
            "empty": await post(served, b""),
            "truncated header": await post(served, good[:30]),
            "text as audio/wav": await post(served, b"hello, this is not audio"),
            "too long": await post(served, wav(6.0)),
            "too large": await post(served, wav(13.0)),
            "too many channels": await post(served, eight_channels),
            "a rate of 4 Hz": await post(served, wav(1.0, rate=4000)[:44] + b"\0" * 8),
            "no frames": await post(served, riff(b"data" + struct.pack("<I", 0))),
        }
        # A header that claims more than its data: the data is what counts.
        claimed = await post(served, bytes(lying), temperature=WARM)
        truncated = await post(served, good[: len(good) // 2], temperature=WARM)
    for name, answer in answers.items():
        assert answer.status_code == 400, (name, answer.text)
        assert answer.json()["error"]["param"] == "file", name
    assert answers["too long"].json()["error"]["code"] == "audio_too_long"
    assert answers["too large"].json()["error"]["code"] == "audio_too_large"
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["usage"]["seconds"] == 1
    assert truncated.status_code == 200, truncated.text


async def test_bad_forms_are_400s_that_name_the_field(
    serve_whisper: ServeWhisper, tiny_model_path: Path
) -> None:
    audio = wav(0.5)
    async with serve_whisper() as served:
        as_json = await served.client.post(
            "/v1/audio/transcriptions", json={"model": MODEL, "file": "x"}
        )
        answers = {
            ("file", "missing"): await post(served, None),
            ("temperature", "invalid_value"): await post(served, audio, temperature=2),
            ("language", "invalid_value"): await post(served, audio, language="xx"),
            ("stream", "invalid_value"): await post(
                served, audio, stream=True, response_format="srt"
            ),
            ("response_format", "invalid_type"): await post(
                served, audio, response_format="mp3"
            ),
            ("include", "unknown_parameter"): await post(
                served, audio, include=["logprobs"]
            ),
            ("timestamp_granularities", "invalid_value"): await post(
                served, audio, timestamp_granularities=["word"]
            ),
            ("beam_size", "unknown_parameter"): await post(served, audio, beam_size=5),
            ("model", "model_not_found"): await post(served, audio, model="nope"),
        }
    assert as_json.status_code == 400
    assert "multipart/form-data" in as_json.json()["error"]["message"]
    for (param, code), answer in answers.items():
        status = 404 if code == "model_not_found" else 400
        assert_error(answer, status, param, code)


@pytest.mark.slow
# asyncio only: under trio, the chat stream left mid-way warns of its
# unclosed socket (the subject here is the MLX thread, not the loop).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_long_transcription_never_stalls_a_chat_stream_for_long(
    tiny_model_path: Path, whisper_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(
        [tiny_model_path, whisper_path],
        served_model_name=("chat", MODEL),
        model_settings=({}, {"model_kind": "transcription"}),
        stream_write_interval=0.0,
    )
    audio = wav(300.0, seed=5)
    form = {"model": MODEL, "temperature": str(WARM)}
    with run_uvicorn(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            wrong = await client.post(
                "/v1/audio/transcriptions",
                data={"model": "chat"},
                files={"file": ("a.wav", wav(0.5))},
            )
            beside = await chat_beside(
                app,
                client,
                lambda c: c.post(
                    "/v1/audio/transcriptions",
                    data=form,
                    files={"file": ("long.wav", audio)},
                ),
                monkeypatch,
                max_tokens=4000,
                leave_early=True,
            )
    assert_error(wrong, 400, "model", "wrong_model_kind")
    # Ten windows, a job of the MLX thread each: the chat's steps run
    # between them, so the stream never waits for the whole file.
    assert beside.last - beside.first >= 10
    assert beside.stalls == []


async def test_a_list_field_is_read_by_the_sdks_name_and_the_documents(
    serve_whisper: ServeWhisper,
) -> None:
    """OpenAI's SDK sends ``timestamp_granularities[]``; OpenAI's OpenAPI
    document names the field ``timestamp_granularities``, a part a value."""
    audio = wav(2.0, seed=6)
    fields = {"response_format": "verbose_json", "timestamp_granularities": ["word"]}
    async with serve_whisper(model=tiny_transcription_path("parakeet")) as served:
        sdk = await post(served, audio, **fields)
        document = await post(served, audio, brackets=False, **fields)
    assert sdk.status_code == document.status_code == 200, document.text
    assert document.json() == sdk.json()
    assert "words" in document.json()
    assert "segments" not in document.json()  # words only, as asked


async def test_parakeet_transcribes_as_mlx_audio_does(
    serve_whisper: ServeWhisper,
) -> None:
    """A second family: Parakeet's CTC (greedy, English, tokens aligned in
    time), each sentence a segment; what it cannot take is a 400."""
    audio = wav(2.0, seed=6)
    async with serve_whisper(model=tiny_transcription_path("parakeet")) as served:
        verbose = await post(
            served,
            audio,
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
        )
        model = engine_of(served).loaded.model
        clip = decode_audio(audio, AudioLimits(), sample_rate=RATE)
        expected = await served.thread.run(
            lambda: model.generate(mx.array(clip.samples))
        )
        refused = {
            "prompt": await post(served, audio, prompt="a cat"),
            "temperature": await post(served, audio, temperature=0.5),
            "language": await post(served, audio, language="fr"),
            "model": await post(served, audio, "/v1/audio/translations"),
        }
        english = await post(served, audio, language="en")
    answer = verbose.json()
    assert verbose.status_code == 200, verbose.text
    assert answer["text"] == expected.text
    tokens = [[t.id for t in s.tokens] for s in expected.sentences]
    assert [s["tokens"] for s in answer["segments"]] == tokens
    assert answer["segments"][0]["avg_logprob"] is None  # Parakeet gives none
    assert "".join(w["word"] for w in answer["words"]).replace(" ", "") == (
        answer["text"].replace(" ", "")
    )
    assert english.status_code == 200
    for param, response in refused.items():
        assert response.status_code == 400, (param, response.text)
        assert response.json()["error"]["param"] == param
