"""``POST /v1/audio/speech``: OpenAI's shape through the openai SDK, whole
and streamed (raw bytes and server-sent events) alike, hostile inputs
(never a 5xx), a client that leaves stopping the generation on the MLX
thread, a chat stream that keeps flowing beside a long speech, and speech
models as models of the one registry."""

from __future__ import annotations

import base64
import io
import json
import struct
import sys
import wave
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import numpy as np
import pytest
from conftest import run_uvicorn

from mlx_pinned.server import create_app
from mlx_pinned.server.kinds.speech.engine import (
    CHUNK_FRAMES,
    SpeechEngine,
    frame_limit,
)
from mlx_pinned.server.kinds.speech.values import SpeechParams
from mlx_pinned.testing import make_tiny_speech, tiny_speech_path

from .conftest import assert_error, until
from .kit import Lifespan, Serve, Served, chat_beside, serving_kind, slow_on_asyncio

pytestmark = pytest.mark.anyio

MODEL = "tts"
TEXT = "Hello there, how are you today?"
RATE = 24000
SAMPLES_PER_FRAME = 1920  # Qwen3-TTS's codec: 12.5 frames a second at 24 kHz


@pytest.fixture(scope="session")
def speech_path() -> Path:
    return tiny_speech_path()


@pytest.fixture
def serve_speech(speech_path: Path, lifespan: Lifespan) -> Serve:
    """An app serving the tiny speech model as ``tts`` (and whatever else a
    test names), its lifespan running."""
    return serving_kind(speech_path, "speech", MODEL, lifespan)


def engine_of(served: Served, name: str = MODEL) -> SpeechEngine:
    engine = served.app.state.models.get(name).engine()
    assert isinstance(engine, SpeechEngine)
    return engine


async def speak(served: Served, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("voice", "vivian")
    return await served.client.post("/v1/audio/speech", json=body)


def samples_of(text: str) -> int:
    """Samples the tiny model makes of ``text``: it never ends its speech
    itself, so it makes the server's frame limit."""
    return frame_limit(text, 8192) * SAMPLES_PER_FRAME


def read_wav(raw: bytes) -> tuple[wave.Wave_read, bytes]:
    reader = wave.open(io.BytesIO(raw), "rb")
    return reader, reader.readframes(len(raw))


@slow_on_asyncio
async def test_the_openai_sdk_speaks_a_wav_of_the_models_length(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        answer = await served.sdk().audio.speech.create(
            model=MODEL, voice="vivian", input=TEXT, response_format="wav"
        )
        raw = answer.read()
    assert answer.response.headers["content-type"] == "audio/wav"
    reader, frames = read_wav(raw)
    assert (reader.getframerate(), reader.getnchannels()) == (RATE, 1)
    assert reader.getsampwidth() == 2
    assert reader.getnframes() == samples_of(TEXT)
    assert len(frames) == 2 * samples_of(TEXT)
    assert np.frombuffer(frames, "<i2").std() > 100  # not silence


@slow_on_asyncio
async def test_pcm_is_the_wavs_samples_and_each_voice_sounds_its_own(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        wav = await speak(served, input=TEXT, response_format="wav")
        pcm = await speak(served, input=TEXT, response_format="pcm")
        again = await speak(served, input=TEXT, response_format="pcm")
        ryan = await speak(served, input=TEXT, response_format="pcm", voice="Ryan")
        other = await speak(served, input=TEXT + "!", response_format="pcm")
    assert pcm.headers["content-type"] == "audio/pcm"
    assert read_wav(wav.content)[1] == pcm.content == again.content
    assert ryan.content != pcm.content
    assert other.content != pcm.content
    assert len(other.content) == 2 * samples_of(TEXT + "!")


@slow_on_asyncio
async def test_mp3_flac_and_opus_are_the_same_speech_encoded(
    serve_speech: Serve,
) -> None:
    import soundfile

    async with serve_speech() as served:
        pcm = await speak(served, input=TEXT, response_format="pcm")
        default = await served.sdk().audio.speech.create(
            model=MODEL, voice="vivian", input=TEXT
        )
        answers = {
            fmt: await speak(served, input=TEXT, response_format=fmt)
            for fmt in ("flac", "opus", "mp3")
        }
        streamed = await speak(
            served, input=TEXT, response_format="opus", stream_format="audio"
        )
    samples = np.frombuffer(pcm.content, "<i2")
    assert default.response.headers["content-type"] == "audio/mpeg"
    assert default.content == answers["mp3"].content  # OpenAI's default, mp3
    decoded = {}
    for fmt, answer in answers.items():
        assert answer.status_code == 200, answer.text
        with soundfile.SoundFile(io.BytesIO(answer.content)) as audio:
            assert (audio.samplerate, audio.channels) == (RATE, 1)
            decoded[fmt] = audio.read(dtype="int16")
    assert answers["flac"].headers["content-type"] == "audio/flac"
    assert answers["opus"].headers["content-type"] == "audio/ogg"
    assert np.array_equal(decoded["flac"], samples)  # lossless
    assert len(decoded["opus"]) == len(samples)
    # Opus is also streamed, page by page: the same packets, so the same
    # samples decoded (its Ogg stream's serial number is drawn at random).
    assert streamed.headers["content-type"] == "audio/ogg"
    with soundfile.SoundFile(io.BytesIO(streamed.content)) as audio:
        assert np.array_equal(audio.read(dtype="int16"), decoded["opus"])
    # An MP3 decoder adds its encoder's delay and padding: a frame or two.
    assert 0 <= len(decoded["mp3"]) - len(samples) < 3 * 1152


@slow_on_asyncio
async def test_speeches_at_once_each_equal_their_own_alone(
    serve_speech: Serve,
) -> None:
    asks = [("vivian", TEXT), ("ryan", TEXT + " Yes."), ("serena", "Hi.")]

    async def one(voice: str, text: str) -> bytes:
        answer = await speak(served, input=text, voice=voice, response_format="pcm")
        assert answer.status_code == 200, answer.text
        return answer.content

    async with serve_speech() as served:
        alone = [await one(voice, text) for voice, text in asks]
        together: list[bytes] = [b""] * len(asks)

        async def into(index: int) -> None:
            together[index] = await one(*asks[index])

        async with anyio.create_task_group() as tasks:
            for index in range(len(asks)):
                tasks.start_soon(into, index)
    # The model's vocoder state is one generation's: they take turns.
    assert together == alone


@slow_on_asyncio
async def test_instructions_steer_the_model_that_takes_them(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        plain = await speak(served, input=TEXT, response_format="pcm")
        steered = await speak(
            served, input=TEXT, response_format="pcm", instructions="Very happy."
        )
    assert steered.status_code == 200, steered.text
    assert len(steered.content) == len(plain.content)
    assert steered.content != plain.content


@slow_on_asyncio
async def test_a_streamed_answer_is_the_whole_answers_bytes(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        whole = await speak(served, input=TEXT, response_format="pcm")
        sdk = served.sdk()
        async with sdk.audio.speech.with_streaming_response.create(
            model=MODEL,
            voice="vivian",
            input=TEXT,
            response_format="pcm",
            stream_format="audio",
        ) as response:
            pieces = [piece async for piece in response.iter_bytes()]
        async with sdk.audio.speech.with_streaming_response.create(
            model=MODEL,
            voice="vivian",
            input=TEXT,
            response_format="wav",
            stream_format="audio",
        ) as response:
            streamed_wav = b"".join([piece async for piece in response.iter_bytes()])
    assert b"".join(pieces) == whole.content
    # The streamed WAV's header cannot know its length: it says the most.
    assert streamed_wav[4:8] == streamed_wav[40:44] == b"\xff\xff\xff\xff"
    reader, frames = read_wav(streamed_wav)
    assert reader.getframerate() == RATE
    assert frames == whole.content


@slow_on_asyncio
async def test_server_sent_events_carry_the_audio_then_the_usage(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        whole = await speak(served, input=TEXT, response_format="pcm")
        sse = await speak(
            served, input=TEXT, response_format="pcm", stream_format="sse"
        )
        tokens = len(engine_of(served).loaded.model.tokenizer.encode(TEXT))
        opus = await speak(
            served, input=TEXT, response_format="opus", stream_format="sse"
        )
    opus_deltas = [
        json.loads(line.removeprefix("data: "))
        for line in opus.text.splitlines()
        if line.startswith("data: ")
    ][:-1]
    # Ogg pages go out as they fill: several while the speech is made.
    assert len(opus_deltas) > 2
    joined = b"".join(base64.b64decode(event["audio"]) for event in opus_deltas)
    assert joined.startswith(b"OggS")
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = [
        json.loads(line.removeprefix("data: "))
        for line in sse.text.splitlines()
        if line.startswith("data: ")
    ]
    deltas, done = events[:-1], events[-1]
    assert {event["type"] for event in deltas} == {"speech.audio.delta"}
    assert len(deltas) > 1
    audio = b"".join(base64.b64decode(event["audio"]) for event in deltas)
    assert audio == whole.content
    frames = frame_limit(TEXT, 8192)
    assert done == {
        "type": "speech.audio.done",
        "usage": {
            "input_tokens": tokens,
            "output_tokens": frames,
            "total_tokens": tokens + frames,
        },
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": "   \n"}, "input"),
        ({"input": "a" * 4097}, "input"),
        ({"input": 7}, "input"),
        ({"input": ["a", "b"]}, "input"),
        ({"input": None}, "input"),
        # These three are checked against the loaded model (its first load
        # takes a second: the imports).
        pytest.param({"voice": "alloy"}, "voice", marks=pytest.mark.slow),
        pytest.param({"voice": {"id": "v_12"}}, "voice", marks=pytest.mark.slow),
        pytest.param({"speed": 2.0}, "speed", marks=pytest.mark.slow),
        ({"voice": 3}, "voice"),
        ({"response_format": "aac"}, "response_format"),
        ({"response_format": "ogg"}, "response_format"),
        ({"response_format": "mp3", "stream_format": "audio"}, "response_format"),
        ({"stream_format": "sse"}, "response_format"),  # mp3, the default
        ({"speed": 0.1}, "speed"),
        ({"speed": 9}, "speed"),
        ({"speed": "fast"}, "speed"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"stream": True}, "stream"),
        ({"temperature": 0.5}, "temperature"),
        ({"instructions": 5}, "instructions"),
    ],
)
async def test_hostile_inputs_are_a_400_that_names_them(
    serve_speech: Serve, body: dict[str, Any], param: str
) -> None:
    body.setdefault("input", TEXT)
    async with serve_speech(load_on_first_use=True) as served:
        answer = await speak(served, **body)
    assert_error(answer, 400, param)


@slow_on_asyncio
async def test_a_missing_field_and_a_broken_body_are_a_400(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        no_voice = await served.client.post(
            "/v1/audio/speech", json={"model": MODEL, "input": TEXT}
        )
        no_input = await speak(served)
        broken = await served.client.post("/v1/audio/speech", content=b"{not json")
        unknown = await speak(served, input=TEXT, model="nope")
        fine = await speak(served, input=TEXT, voice={"id": "serena"})
        wide = "你好 世界 🎉 ça va?"
        unicode = await speak(served, input=wide, response_format="pcm")
    assert unicode.status_code == 200, unicode.text
    assert len(unicode.content) == 2 * samples_of(wide)  # counted in characters
    assert_error(no_voice, 400, "voice")
    assert_error(no_input, 400, "input")
    assert broken.status_code == 400
    assert_error(unknown, 404, "model", "model_not_found")
    assert fine.status_code == 200, fine.text


@slow_on_asyncio
async def test_instructions_to_a_model_that_takes_none_are_refused(
    serve_speech: Serve, tmp_path: Path
) -> None:
    folder = make_tiny_speech(tmp_path / "small")
    config = json.loads((folder / "config.json").read_text())
    config["tts_model_size"] = "0b6"  # mlx-audio drops the 0.6B's instructions
    (folder / "config.json").write_text(json.dumps(config))
    async with serve_speech(model=folder) as served:
        refused = await speak(served, input=TEXT, instructions="Whisper.")
        fine = await speak(served, input=TEXT, instructions="")
    assert_error(refused, 400, "instructions")
    assert fine.status_code == 200, fine.text


@slow_on_asyncio
async def test_each_kind_is_sent_to_its_own_routes(
    serve_speech: Serve, tiny_model_path: Path, speech_path: Path
) -> None:
    async with serve_speech(
        model=[tiny_model_path, speech_path],
        served_model_name=("chat", MODEL),
        model_kind="chat",
        model_settings=({}, {"model_kind": "speech"}),
    ) as served:
        chat_here = await speak(served, model="chat", input=TEXT)
        speech_there = await served.chat(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        embed_there = await served.client.post(
            "/v1/embeddings", json={"model": MODEL, "input": "hi"}
        )
        spoken = await speak(served, input=TEXT)
        listing = (await served.client.get("/v1/models")).json()["data"]
        health = (await served.client.get("/health")).json()
        metrics = await served.client.get("/metrics")
    error = assert_error(chat_here, 400, "model", "wrong_model_kind")
    assert "/v1/chat/completions" in error["message"]
    error = assert_error(speech_there, 400, "model", "wrong_model_kind")
    assert "a speech model" in error["message"]
    assert "/v1/audio/speech" in error["message"]
    assert_error(embed_there, 400, "model", "wrong_model_kind")
    assert spoken.status_code == 200, spoken.text
    assert [(card["id"], card["kind"]) for card in listing] == [
        ("chat", "chat"),
        (MODEL, "speech"),
    ]
    assert health["models"][MODEL]["loaded"] is True
    assert f'mlx_pinned_model_loaded{{model="{MODEL}"}} 1.0' in metrics.text


@slow_on_asyncio
async def test_a_speech_model_loads_on_first_use_unloads_and_counts_its_bytes(
    serve_speech: Serve, speech_path: Path
) -> None:
    async with serve_speech(load_on_first_use=True, idle_unload_timeout=0.3) as served:
        slot = served.app.state.models.get(MODEL).slot
        assert slot.engine is None
        before = served.app.state.residency.weight_bytes()
        first = await speak(served, input=TEXT, response_format="pcm")
        held = served.app.state.residency.weight_bytes()
        assert slot.loads == 1
        with anyio.fail_after(20):
            await until(lambda: slot.engine is None)
        again = await speak(served, input=TEXT, response_format="pcm")
    assert first.content == again.content
    assert (slot.loads, slot.unloads) == (2, 1)
    vocoder = speech_path / "speech_tokenizer" / "model.safetensors"
    files = [speech_path / "model.safetensors", vocoder]
    assert held - before == sum(tensor_bytes(file) for file in files)


def tensor_bytes(file: Path) -> int:
    """Bytes of the tensors of a safetensors file, from its header."""
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    return sum(
        end - start
        for key, item in header.items()
        if key != "__metadata__"
        for start, end in [item["data_offsets"]]
    )


@pytest.mark.slow
async def test_a_client_that_leaves_stops_the_generation(speech_path: Path) -> None:
    text = "a long speech " * 40
    total = frame_limit(text, 8192)
    app = create_app(speech_path, served_model_name=MODEL, model_kind="speech")
    body = {"model": MODEL, "voice": "ryan", "input": text, "response_format": "pcm"}
    # Under uvicorn, over a bare socket: the client's leaving reaches the app
    # as a disconnect (and no client library is left half-read).
    with run_uvicorn(app) as url:
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps({**body, "stream_format": "audio"}).encode()
        head = (
            f"POST /v1/audio/speech HTTP/1.1\r\nhost: {host}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        )
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(head.encode() + payload)
            received = b""
            while b"\r\n\r\n" not in received:  # the status, then leave
                received += await stream.receive()
        assert received.startswith(b"HTTP/1.1 200")
        engine = app.state.models.get(MODEL).engine()
        assert isinstance(engine, SpeechEngine)
        with anyio.fail_after(20):
            await until(lambda: engine.speaking == 0)
        made = engine.frames
        # Jobs run in turn with any generation's pieces: one still going
        # would make frames meanwhile.
        for _ in range(3):
            await app.state.mlx_thread.run(lambda: None)
        after = engine.frames
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            fine = await client.post("/v1/audio/speech", json={**body, "input": TEXT})
    assert made == after, "the generation went on after it was closed"
    # The stream reads a few pieces ahead of its consumer, no more.
    assert CHUNK_FRAMES <= made < total // 2, (made, total)
    assert fine.status_code == 200
    assert len(fine.content) == 2 * samples_of(TEXT)


@pytest.mark.slow
async def test_a_closed_stream_of_the_engine_makes_no_more_frames(
    serve_speech: Serve,
) -> None:
    async with serve_speech() as served:
        engine = engine_of(served)
        speech = engine.speak(SpeechParams("word " * 100, "vivian"))
        first = await speech.__anext__()
        await speech.aclose()
        made = engine.frames
        for _ in range(3):  # a generation still going would make frames meanwhile
            await served.thread.run(lambda: None)
    assert first.frames == CHUNK_FRAMES
    assert engine.frames == made < frame_limit("word " * 100, 8192)
    assert engine.speaking == 0


@pytest.mark.slow
def test_the_sdk_speaks_through_a_served_config_file(
    tmp_path: Path, tiny_model_path: Path, speech_path: Path
) -> None:
    from .kit import running

    config = tmp_path / "models.toml"
    config.write_text(
        f'[[models]]\npath = "{tiny_model_path}"\nname = "chat"\n\n'
        f'[[models]]\npath = "{speech_path}"\nname = "{MODEL}"\n'
        'model_kind = "speech"\nload_on_first_use = true\n'
    )
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += ["--config", str(config), "--port", "0"]
    with running(command, tmp_path / "log") as server, server.client() as client:
        whole = client.audio.speech.create(
            model=MODEL, voice="serena", input=TEXT, response_format="pcm"
        ).read()
        with client.audio.speech.with_streaming_response.create(
            model=MODEL,
            voice="serena",
            input=TEXT,
            response_format="pcm",
            stream_format="audio",
        ) as response:
            streamed = b"".join(response.iter_bytes())
        listed = {m.id: cast(Any, m).kind for m in client.models.list()}
    assert streamed == whole
    assert len(whole) == 2 * samples_of(TEXT)
    assert listed == {"chat": "chat", MODEL: "speech"}


@slow_on_asyncio
async def test_a_long_speech_never_stalls_a_chat_stream_for_long(
    tiny_model_path: Path, speech_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "A long speech beside a chat stream. " * 6
    app = create_app(
        [tiny_model_path, speech_path],
        served_model_name=("chat", MODEL),
        model_settings=({}, {"model_kind": "speech"}),
        stream_write_interval=0.0,
    )
    body = {"model": MODEL, "voice": "vivian", "input": text}
    with run_uvicorn(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            beside = await chat_beside(
                app,
                client,
                lambda c: c.post("/v1/audio/speech", json=body),
                monkeypatch,
                max_tokens=1500,
            )
    # A piece is a job of the MLX thread; a chat step runs between each two.
    assert beside.last - beside.first > 20
    assert beside.stalls == []


@pytest.mark.slow
async def test_a_speech_past_the_deadline_is_a_504_and_stops(
    serve_speech: Serve,
) -> None:
    text = "a long speech " * 60
    async with serve_speech(request_timeout=0.3) as served:
        engine = engine_of(served)
        late = await speak(served, input=text)
        with anyio.fail_after(20):
            await until(lambda: engine.speaking == 0)
        made = engine.frames
    assert_error(late, 504)
    assert made < frame_limit(text, 8192) // 2
