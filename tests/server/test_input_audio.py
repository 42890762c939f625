"""``input_audio`` parts in chat completions: OpenAI's shape through the
openai SDK, the parts as the decoder and the engine take them, hostile
parts (always a 400 that names the part, never a 5xx), a model that takes
no audio, and the engine: batched equals alone, and the prompt cache keyed
by the audio's content."""

from __future__ import annotations

import base64
import io
import struct
import wave
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import create_app, engine
from mlx_pinned.server.config import AudioLimits, ServerConfig
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.model import serial_reason
from mlx_pinned.server.engine.prompt_cache import audio_hash, prompt_key
from mlx_pinned.server.engine.rows import make_row, media_tokens
from mlx_pinned.server.events import GenerationParams, SamplingParams
from mlx_pinned.server.failures import AudioRefusedError
from mlx_pinned.server.http.chat_completions.messages import (
    audio_parts,
    audio_refs,
    chat_messages,
)
from mlx_pinned.server.http.chat_completions.protocol import parse_chat_request
from mlx_pinned.server.http.errors import APIError, api_error
from mlx_pinned.server.inputs.audio import decode_part
from mlx_pinned.server.media import Audio, AudioInput, AudioRef
from mlx_pinned.testing import TINY_OMNI_TYPES, tiny_lm_path, tiny_omni_path

from .conftest import assert_error
from .kit import (
    TOL,
    Event,
    Lifespan,
    Served,
    all_at_once,
    image,
    in_process,
    logprobs,
    max_logprob_difference,
    solo,
)

pytestmark = pytest.mark.anyio

MODEL = "omni"
RATE = 16000
# A second of audio is 25 audio tokens (40 ms each) between two markers.
TOKENS_PER_SECOND = 25

ServeOmni = Callable[..., AbstractAsyncContextManager[Served]]


def wav(seconds: float, *, seed: int = 0, rate: int = RATE) -> bytes:
    """A WAV file of ``seconds`` of a noisy tone (16-bit mono PCM)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t)
    tone += 0.05 * rng.standard_normal(len(t))
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((tone * 32767).astype("<i2").tobytes())
    return out.getvalue()


def silent_mp3(frames: int = 40) -> bytes:
    """An MP3 of ``frames`` silent MPEG-1 Layer III frames (128 kbit/s,
    44.1 kHz, joint stereo: 417 bytes each), about a second."""
    return (b"\xff\xfb\x90\x64" + bytes(413)) * frames


def lying_wav(seconds: float) -> bytes:
    """A one-second WAV whose header claims ``seconds`` of audio."""
    data = bytearray(wav(1.0))
    claimed = int(seconds * RATE) * 2
    struct.pack_into("<I", data, 4, claimed + 36)
    struct.pack_into("<I", data, 40, claimed)
    return bytes(data)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes | str, audio_format: str = "wav") -> dict[str, Any]:
    encoded = data if isinstance(data, str) else b64(data)
    return {
        "type": "input_audio",
        "input_audio": {"data": encoded, "format": audio_format},
    }


def audio_chat(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A chat with one user turn: a text part, then ``parts``."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is said?"}, *parts],
            }
        ],
    }
    body.update(fields)
    return body


@pytest.fixture(scope="session")
def omni_path() -> Path:
    return tiny_omni_path()


@pytest.fixture
def serve_omni(omni_path: Path, lifespan: Lifespan) -> ServeOmni:
    """An app serving the tiny Gemma 4 as ``omni``, its lifespan running."""

    @asynccontextmanager
    async def serve(**options: Any) -> AsyncIterator[Served]:
        options.setdefault("served_model_name", MODEL)
        app = create_app(options.pop("model", omni_path), **options)
        async with in_process(app, lifespan, Served) as served:
            yield served

    return serve


class TestParts:
    """The parts as the request holds them, with no model."""

    def test_parts_are_named_and_marked_in_place(self) -> None:
        body = audio_chat(audio_part(wav(0.1)), {"type": "text", "text": "and?"})
        request = parse_chat_request(httpx.Request("POST", "/", json=body).content)
        assert audio_parts(request.messages) == ["messages[0].content[1].input_audio"]
        (turn,) = chat_messages(request.messages)
        assert [part["type"] for part in turn["content"]] == ["text", "audio", "text"]
        (ref,) = audio_refs(request.messages, AudioLimits())
        assert (ref.index, ref.format) == (0, "wav")

    def test_more_files_than_the_limit_name_the_first_over_it(self) -> None:
        parts = [audio_part(wav(0.1, seed=n)) for n in range(3)]
        request = parse_chat_request(
            httpx.Request("POST", "/", json=audio_chat(*parts)).content
        )
        with pytest.raises(AudioRefusedError) as caught:
            audio_refs(request.messages, AudioLimits(max_audios=2))
        assert (caught.value.index, caught.value.code) == (2, "too_many_audios")
        error = api_error(
            caught.value, retry_after=1, places=audio_parts(request.messages)
        )
        assert isinstance(error, APIError)
        assert (error.status, error.param) == (
            400,
            "messages[0].content[3].input_audio",
        )

    def test_a_format_other_than_wav_or_mp3_is_refused_by_the_schema(self) -> None:
        body = audio_chat(audio_part(wav(0.1), "flac"))
        with pytest.raises(APIError) as caught:
            parse_chat_request(httpx.Request("POST", "/", json=body).content)
        assert caught.value.status == 400
        assert "input_audio" in (caught.value.param or "")

    def test_the_server_setting_bounds_the_count(self) -> None:
        assert ServerConfig(model="m").audio_limits.max_audios == 2
        assert ServerConfig(model="m", max_audios=5).audio_limits.max_audios == 5


class TestDecoding:
    """:func:`decode_part`: base64, the named format, then the decoder."""

    def refused(self, data: str, audio_format: str = "wav", **limits: Any) -> str:
        with pytest.raises(AudioRefusedError) as caught:
            decode_part(
                AudioRef(3, data, audio_format), AudioLimits(**limits), sample_rate=RATE
            )
        assert caught.value.index == 3
        return caught.value.code

    def test_a_wav_decodes_to_mono_at_the_models_rate(self) -> None:
        audio = decode_part(
            AudioRef(0, b64(wav(0.5, rate=8000)), "wav"),
            AudioLimits(),
            sample_rate=RATE,
        )
        assert audio.sample_rate == RATE
        assert audio.samples.shape == (RATE // 2,)
        assert audio.seconds == pytest.approx(0.5)

    def test_an_mp3_decodes(self) -> None:
        audio = decode_part(
            AudioRef(0, b64(silent_mp3()), "mp3"), AudioLimits(), sample_rate=RATE
        )
        assert 0.9 < audio.seconds < 1.1

    def test_the_digest_follows_the_samples(self) -> None:
        def digest(data: bytes) -> str:
            return decode_part(
                AudioRef(0, b64(data), "wav"), AudioLimits(), sample_rate=RATE
            ).digest

        assert digest(wav(0.2)) == digest(wav(0.2))
        assert digest(wav(0.2)) != digest(wav(0.2, seed=1))

    def test_bad_base64_is_refused(self) -> None:
        assert self.refused("not base64!") == "invalid_base64"
        uri = "data:audio/wav;base64," + b64(wav(0.1))
        assert self.refused(uri) == "invalid_base64"

    def test_a_format_the_bytes_are_not_is_refused(self) -> None:
        assert self.refused(b64(wav(0.1)), "mp3") == "audio_format_mismatch"
        assert self.refused(b64(silent_mp3()), "wav") == "audio_format_mismatch"
        assert self.refused(b64(b"just some text"), "wav") == "audio_format_mismatch"

    def test_zero_bytes_are_refused(self) -> None:
        assert self.refused("") == "invalid_audio"

    def test_limits_are_checked_before_decoding(self) -> None:
        assert self.refused(b64(wav(1.0)), max_bytes=1000) == "audio_too_large"
        assert self.refused(b64(wav(2.0)), max_seconds=1.0) == "audio_too_long"

    def test_a_header_that_claims_more_than_its_data_is_read_as_the_data(
        self,
    ) -> None:
        data = b64(lying_wav(7200.0))
        audio = decode_part(AudioRef(0, data, "wav"), AudioLimits(), sample_rate=RATE)
        assert audio.seconds == pytest.approx(1.0)


class TestFamily:
    def test_gemma4_batches_only_where_it_is_proven(self) -> None:
        def config(**text: int) -> SimpleNamespace:
            text_config = SimpleNamespace(**text)
            return SimpleNamespace(model_type="gemma4", text_config=text_config)

        assert serial_reason(config()) is None
        shared = serial_reason(config(num_kv_shared_layers=20))
        assert shared is not None
        assert "shared-KV" in shared
        assert serial_reason(config(hidden_size_per_layer_input=256)) is not None


class TestPromptKey:
    def test_each_audio_run_is_keyed_by_its_file(self) -> None:
        audio, image = 11, 8
        ids = [2, 4, 9, audio, audio, audio, 10, 5, 6, image, image, 7]
        key = prompt_key(
            ids, [123], frozenset({audio, image}), audios=[456], audio_token=audio
        )
        assert key is not None
        assert list(key[3:6]) == [-457] * 3
        assert list(key[9:11]) == [-124] * 2
        other = prompt_key(
            ids, [123], frozenset({audio, image}), audios=[789], audio_token=audio
        )
        assert other is not None
        assert list(other[:3]) == list(key[:3])
        assert other[3] != key[3]

    def test_runs_that_do_not_match_the_files_are_not_cached(self) -> None:
        ids = [2, 11, 11, 3, 11, 4]
        assert prompt_key(ids, [], frozenset({11}), audios=[1], audio_token=11) is None

    def test_an_audio_digest_is_a_key_value(self) -> None:
        value = audio_hash("f" * 64)
        assert 0 <= value < 2**62


def decoded(seconds: float, seed: int = 0) -> Audio:
    ref = AudioRef(0, b64(wav(seconds, seed=seed)), "wav")
    return decode_part(ref, AudioLimits(), sample_rate=RATE)


def heard(
    audio: Audio | None, max_tokens: int, text: str = "What is said?", **kw: Any
) -> tuple[GenerationParams, list[Any]]:
    """A request of ``text`` and ``audio`` (none: text alone); ``image``: a
    size, for an image part too."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    images = []
    if kw.get("image"):
        content.append({"type": "image_url"})
        images.append(image(kw["image"], seed=max_tokens))
    if audio is not None:
        content.append({"type": "audio"})
    params = GenerationParams(
        ({"role": "user", "content": content},),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        audios=() if audio is None else (audio,),
    )
    return params, images


async def run(
    batch: BatchEngine, req: tuple[GenerationParams, list[Any]]
) -> list[Event]:
    async with batch.stream(*req) as stream:
        return [event async for event in stream]


@pytest.fixture(scope="module")
def loaded_omni(thread: MLXThread) -> LoadedModel:
    model: LoadedModel = thread.run_sync(engine.load, tiny_omni_path())
    return model


@pytest.mark.slow
class TestEngine:
    async def test_audio_batched_with_others_matches_it_alone_and_mlx_vlm(
        self, thread: MLXThread, loaded_omni: LoadedModel
    ) -> None:
        reqs = [
            heard(decoded(1.0), 12),
            heard(decoded(0.4, seed=1), 9, "Who speaks?"),
            heard(
                decoded(1.5, seed=2),
                14,
                "Describe this image in one sentence.",
                image=(64, 64),
            ),
            heard(None, 10),
            heard(None, 7, "The quick brown fox jumps over the lazy dog."),
            heard(None, 11, "Count the objects.", image=(32, 32)),
        ]
        alone = [await run(BatchEngine(loaded_omni, thread), req) for req in reqs]
        batch = BatchEngine(loaded_omni, thread)
        assert batch.facts.audio_input == AudioInput(RATE, 30.0)
        runs = await all_at_once(thread, batch, reqs, seconds=120)
        assert max(run_.active_at_start for run_ in runs) > 1
        for run_, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run_.events, expected) <= TOL
        for req, expected in zip(reqs[:3], alone[:3], strict=True):
            assert (
                max_logprob_difference(await solo(thread, loaded_omni, req), expected)
                <= TOL
            )

    async def test_the_engine_refuses_what_the_model_cannot_hear(
        self, thread: MLXThread, loaded_omni: LoadedModel
    ) -> None:
        long = decoded(30.5)
        twice = GenerationParams(
            ({"role": "user", "content": [{"type": "audio"}, {"type": "audio"}]},),
            max_tokens=1,
            audios=(decoded(0.2), decoded(0.3, seed=1)),
        )
        for params, index, code in [
            (heard(long, 1)[0], 0, "audio_too_long"),
            (twice, 1, "too_many_audios"),
        ]:
            with pytest.raises(AudioRefusedError) as caught:
                await thread.run(make_row, loaded_omni, params, [])
            assert (caught.value.index, caught.value.code) == (index, code)

    async def test_the_key_holds_the_audio_and_the_image(
        self, thread: MLXThread, loaded_omni: LoadedModel
    ) -> None:
        media = media_tokens(loaded_omni)
        audio_id = loaded_omni.model.config.audio_token_id

        def key(audio: Audio) -> Any:
            params, images = heard(audio, 4, image=(64, 64))
            return make_row(loaded_omni, params, images, media=media).key

        one, other = [await thread.run(key, decoded(1.0, seed=s)) for s in (0, 1)]
        assert one is not None
        assert other is not None
        assert audio_id in media
        assert audio_id not in set(one.tolist())  # every audio token replaced
        assert len(one) == len(other)
        changed = np.flatnonzero(one != other)
        assert len(changed) == TOKENS_PER_SECOND  # the audio's tokens only


@pytest.mark.slow
class TestServed:
    """The app, serving the tiny Gemma 4."""

    async def test_the_openai_sdk_sends_an_audio_part(
        self, serve_omni: ServeOmni
    ) -> None:
        assert TINY_OMNI_TYPES == ("gemma4",)
        async with serve_omni() as served:
            client = served.sdk()
            completion = await client.chat.completions.create(
                model=MODEL,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is said?"},
                            {
                                "type": "input_audio",
                                "input_audio": {"data": b64(wav(1.0)), "format": "wav"},
                            },
                        ],
                    }
                ],
            )
            text_only = await client.chat.completions.create(
                model=MODEL,
                max_tokens=4,
                messages=[{"role": "user", "content": "What is said?"}],
            )
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 4
        assert text_only.usage is not None
        # The audio's tokens and its two markers.
        extra = completion.usage.prompt_tokens - text_only.usage.prompt_tokens
        assert extra == TOKENS_PER_SECOND + 2

    async def test_an_mp3_part_is_taken(self, serve_omni: ServeOmni) -> None:
        async with serve_omni() as served:
            response = await served.chat(audio_chat(audio_part(silent_mp3(), "mp3")))
        assert len(logprobs(response)) == 6

    async def test_the_audio_changes_the_answer(self, serve_omni: ServeOmni) -> None:
        async with serve_omni() as served:
            first = logprobs(await served.chat(audio_chat(audio_part(wav(1.0)))))
            second = logprobs(
                await served.chat(audio_chat(audio_part(wav(1.0, seed=1))))
            )
        assert max(abs(a - b) for a, b in zip(first, second, strict=True)) > 1e-3

    async def test_hostile_parts_are_400s_that_name_them(
        self, serve_omni: ServeOmni
    ) -> None:
        place = "messages[0].content[1].input_audio"
        cases = [
            (audio_part("@@@@"), "invalid_base64"),
            (audio_part(wav(0.5), "mp3"), "audio_format_mismatch"),
            (audio_part(wav(1.5)), "audio_too_long"),
            (audio_part(wav(1.0, rate=48000)), "audio_too_large"),
            (audio_part(b"RIFF\x00\x00\x00\x00WAVEfmt "), "invalid_audio"),
        ]
        async with serve_omni(max_audio_seconds=1.0, max_audio_bytes=64_000) as served:
            for part, code in cases:
                response = await served.chat(audio_chat(part))
                error = assert_error(response, 400, place, code)
                assert place in error["message"]
            empty = await served.chat(audio_chat(audio_part("")))
            assert empty.status_code == 400
            assert_error(empty, 400, empty.json()["error"]["param"])
            assert "input_audio" in empty.json()["error"]["param"]
            three = [audio_part(wav(0.2, seed=n)) for n in range(3)]
            many = await served.chat(audio_chat(*three))
            assert_error(
                many, 400, "messages[0].content[3].input_audio", "too_many_audios"
            )
            # Gemma 4's mlx-vlm embedding misplaces a second file: one a prompt.
            two = await served.chat(audio_chat(*three[:2]))
            assert_error(
                two, 400, "messages[0].content[2].input_audio", "too_many_audios"
            )
            # A header that lies long: its one second of data is what counts.
            alive = await served.chat(audio_chat(audio_part(lying_wav(7200.0))))
        assert alive.status_code == 200, alive.text

    async def test_a_file_longer_than_the_model_hears_names_the_part(
        self, serve_omni: ServeOmni
    ) -> None:
        # Gemma 4 hears 30 seconds a file (750 tokens of 40 ms): the
        # processor would drop the rest unheard. Refused from the header.
        async with serve_omni() as served:
            long = await served.chat(audio_chat(audio_part(wav(30.5))))
            heard = await served.chat(audio_chat(audio_part(wav(30.0)), max_tokens=1))
        place = "messages[0].content[1].input_audio"
        error = assert_error(long, 400, place, "audio_too_long")
        assert "the limit of 30 seconds" in error["message"]
        assert heard.status_code == 200, heard.text
        assert heard.json()["usage"]["prompt_tokens"] > 750

    @pytest.mark.parametrize("kind", ["text", "vision"])
    async def test_a_model_without_audio_names_the_part(
        self, kind: str, serve_omni: ServeOmni, tiny_model_path: Path
    ) -> None:
        model = tiny_lm_path() if kind == "text" else tiny_model_path
        async with serve_omni(model=model) as served:
            response = await served.chat(audio_chat(audio_part(wav(0.5))))
        place = "messages[0].content[1].input_audio"
        error = assert_error(response, 400, place, "audio_unsupported")
        assert "takes no audio" in error["message"]

    async def test_batched_beside_others_equals_alone(
        self, serve_omni: ServeOmni
    ) -> None:
        asked = audio_chat(audio_part(wav(1.0)), max_tokens=12)
        hello = {**audio_chat(), "messages": [{"role": "user", "content": "Hello!"}]}
        others = [audio_chat(audio_part(wav(0.6, seed=2))), hello]
        async with serve_omni(max_num_seqs=4, prompt_cache_bytes=0) as served:
            assert not served.engine._state.exclusive
            alone = logprobs(await served.chat(asked))
            answers: dict[str, httpx.Response] = {}

            async def send(name: str, body: dict[str, Any]) -> None:
                answers[name] = await served.chat(body)

            for other in others:
                async with anyio.create_task_group() as group:
                    group.start_soon(send, "other", {**other, "max_tokens": 16})
                    group.start_soon(send, "asked", asked)
                together = logprobs(answers["asked"])
                worst = max(abs(a - b) for a, b in zip(together, alone, strict=True))
                assert worst <= TOL

    async def test_the_same_audio_hits_the_cache_another_does_not(
        self, serve_omni: ServeOmni
    ) -> None:
        body = audio_chat(audio_part(wav(1.0)))
        async with serve_omni() as served:
            first = await served.chat(body)
            again = await served.chat(body)
            other = await served.chat(audio_chat(audio_part(wav(1.0, seed=1))))
            reused = served.engine._state.prompt_cache.statistics().reused_tokens
        cached = [
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            for r in (first, again, other)
        ]
        prompt = first.json()["usage"]["prompt_tokens"]
        assert cached[0] == 0
        assert cached[1] == prompt - 1  # all but the last token
        # The other file shares the text before it, never its audio tokens.
        assert 0 < cached[2] < prompt - TOKENS_PER_SECOND
        assert reused == cached[1] + cached[2]
        worst = max(
            abs(a - b) for a, b in zip(logprobs(first), logprobs(again), strict=True)
        )
        assert worst <= TOL

    async def test_the_responses_and_messages_apis_refuse_an_audio_part(
        self, serve_omni: ServeOmni
    ) -> None:
        turn = {"role": "user", "content": [audio_part(wav(0.2))]}
        async with serve_omni() as served:
            responses = await served.client.post(
                "/v1/responses", json={"model": MODEL, "input": [turn]}
            )
            messages = await served.client.post(
                "/v1/messages",
                json={"model": MODEL, "max_tokens": 4, "messages": [turn]},
            )
        for response in (responses, messages):
            assert response.status_code == 400, response.text
            assert "input_audio" in response.text


async def test_the_sdk_error_is_a_bad_request(serve_omni: ServeOmni) -> None:
    """Refused as the body is parsed, before the model is loaded."""
    async with serve_omni(load_on_first_use=True) as served:
        client = served.sdk()
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [audio_part(wav(0.1), "ogg")]}],  # type: ignore[list-item]
            )
    assert caught.value.status_code == 400
    assert served.app.state.models.get(MODEL).engine() is None
