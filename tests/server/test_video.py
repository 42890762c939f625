"""Video parts: decoding and its bounds, the request's fields, the engine
(batched equals alone, the caches key on content), the app end to end."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import create_app, engine
from mlx_pinned.server.config import ServerConfig, VideoLimits
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.model_inputs import preprocess
from mlx_pinned.server.engine.rows import make_row, media_tokens
from mlx_pinned.server.events import FinalEvent, GenerationParams, SamplingParams
from mlx_pinned.server.failures import VideoRefusedError
from mlx_pinned.server.http.chat_completions.messages import (
    chat_messages,
    video_refs,
)
from mlx_pinned.server.http.chat_completions.protocol import parse_chat_request
from mlx_pinned.server.http.errors import api_error
from mlx_pinned.server.inputs.videos import decode_video, load_videos
from mlx_pinned.server.media import Video, VideoRef
from mlx_pinned.testing import tiny_vlm_path

from .conftest import MODEL, assert_error
from .kit import (
    TOL,
    Event,
    Lifespan,
    Serve,
    all_at_once,
    max_logprob_difference,
    request,
    video_bytes,
    video_data_uri,
)
from .openapi import CheckedTransport

pytestmark = pytest.mark.anyio

CLIP = video_bytes()  # 8 frames of 64x64 at 4 fps: 2 s


def decoded(seed: int = 0, **limits: Any) -> Video:
    data = video_bytes(seed=seed)
    return decode_video(VideoRef(0, video_data_uri(data)), VideoLimits(**limits))


@contextmanager
def frames_read() -> Iterator[list[str]]:
    """The frames decoded meanwhile (OpenCV's grab and read calls), as a
    list that fills while the block runs."""
    import cv2

    reads: list[str] = []
    capture = cv2.VideoCapture

    class Counted:
        def __init__(self, *args: Any) -> None:
            self._inner = capture(*args)

        def grab(self) -> Any:
            reads.append("grab")
            return self._inner.grab()

        def read(self) -> Any:
            reads.append("read")
            return self._inner.read()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cv2, "VideoCapture", Counted)
        yield reads


def refused(
    url: str, limits: VideoLimits | None = None, *, reads: int = 0
) -> VideoRefusedError:
    """The refusal of ``url``, once at most ``reads`` frames were decoded
    (none: refused from the container's headers)."""
    with frames_read() as read, pytest.raises(VideoRefusedError) as caught:
        decode_video(VideoRef(0, url), limits or VideoLimits())
    assert len(read) <= reads, read
    return caught.value


def _patched_avi(data: bytes, *, frames: int | None = None) -> bytes:
    """``data`` (an MJPG AVI) whose headers claim ``frames`` frames."""
    out = bytearray(data)
    avih, strh = data.find(b"avih"), data.find(b"strh")
    if frames is not None:
        struct.pack_into("<I", out, avih + 8 + 16, frames)
        struct.pack_into("<I", out, strh + 8 + 32, frames)
    return bytes(out)


def _huge_frames(data: bytes, side: int) -> bytes:
    """``data`` whose JPEG frames each claim to be ``side`` x ``side``."""
    out = bytearray(data)
    for found in re.finditer(rb"\xff\xc0", data):
        struct.pack_into(">HH", out, found.start() + 5, side, side)
    return bytes(out)


class TestDecoding:
    def test_frames_are_sampled_at_the_default_rate_an_even_count(self) -> None:
        video = decoded()
        # 2 s at 2 fps: 4 frames, spread over the clip.
        assert video.frames.shape == (4, 3, 64, 64)
        assert video.frames.dtype == np.uint8
        assert video.indices == (0, 2, 5, 7)
        assert (video.fps, video.total_frames) == (4.0, 8)

    def test_the_request_sets_the_rate_and_the_cap_within_the_servers(self) -> None:
        url = video_data_uri(CLIP)
        slow = decode_video(VideoRef(0, url, fps=1.0), VideoLimits())
        assert slow.indices == (0, 7)
        capped = decode_video(VideoRef(0, url, fps=4.0, max_frames=6), VideoLimits())
        assert len(capped.indices) == 6
        ceiling = decode_video(
            VideoRef(0, url, fps=4.0, max_frames=8), VideoLimits(max_frames=2)
        )
        assert len(ceiling.indices) == 2

    def test_mp4_decodes_too(self) -> None:
        data = video_bytes(codec="mp4v", suffix=".mp4")
        video = decode_video(
            VideoRef(0, video_data_uri(data, "video/mp4")), VideoLimits()
        )
        assert video.frames.shape == (4, 3, 64, 64)

    def test_the_digest_follows_the_frames(self) -> None:
        assert decoded(0).digest == decoded(0).digest
        assert decoded(0).digest != decoded(1).digest

    def test_a_claimed_huge_frame_count_is_refused_before_decoding(self) -> None:
        bomb = _patched_avi(CLIP, frames=10**9)
        error = refused(video_data_uri(bomb))
        assert error.code == "video_too_long"

    def test_frames_claiming_a_huge_canvas_are_refused(self) -> None:
        for side in (8000, 30000):
            # At its first frame at most, not after all of them.
            error = refused(video_data_uri(_huge_frames(CLIP, side)), reads=1)
            assert error.code in ("video_too_large", "invalid_video")

    def test_undecodable_bytes_are_refused(self) -> None:
        noise = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
        error = refused(video_data_uri(noise.tobytes(), "video/mp4"))
        assert error.code == "invalid_video"

    def test_too_long_too_many_pixels_too_many_bytes(self) -> None:
        url = video_data_uri(CLIP)
        assert refused(url, VideoLimits(max_seconds=1.0)).code == "video_too_long"
        assert refused(url, VideoLimits(max_pixels=1000)).code == "video_too_large"
        assert refused(url, VideoLimits(max_bytes=1000)).code == "video_too_large"

    def test_urls_other_than_data_uris_are_refused(self) -> None:
        assert refused("/etc/passwd").code == "invalid_video_url"
        assert refused("file:///tmp/x.mp4").code == "invalid_video_url"
        assert refused("data:image/png;base64,AAAA").code == "invalid_video_format"
        assert refused("data:video/mp4,AAAA").code == "invalid_base64"
        assert refused("data:video/mp4;base64,@@@@").code == "invalid_base64"

    async def test_decoding_runs_on_a_worker_thread(self) -> None:
        seen: list[int] = []
        original = decode_video

        def spy(*args: Any) -> Video:
            seen.append(threading.get_ident())
            return original(*args)

        refs = [VideoRef(0, video_data_uri(CLIP))]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("mlx_pinned.server.inputs.videos.decode_video", spy)
            videos = await load_videos(refs, VideoLimits())
        assert len(videos) == 1
        assert seen
        assert seen[0] != threading.get_ident()

    async def test_remote_urls_need_the_switch_and_use_the_fetcher(self) -> None:
        refs = [VideoRef(0, "https://example.com/clip.avi")]
        with pytest.raises(VideoRefusedError) as caught:
            await load_videos(refs, VideoLimits())
        assert caught.value.code == "remote_videos_disabled"
        fetched: list[str] = []

        async def fetch(url: str) -> bytes:
            fetched.append(url)
            return CLIP

        videos = await load_videos(refs, VideoLimits(), fetch=fetch)
        assert fetched == ["https://example.com/clip.avi"]
        assert videos[0].frames.shape == (4, 3, 64, 64)


def body(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "What happens in this video?"}, *parts]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0.0,
        **fields,
    }


def video_part(data: bytes = CLIP) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": video_data_uri(data)}}


class TestRequests:
    def test_a_video_part_becomes_a_marker_in_place(self) -> None:
        image = {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}
        string_form = {"type": "video_url", "video_url": "data:video/mp4;base64,AA"}
        raw = body(video_part(), image, string_form, video_fps=1.5, video_max_frames=4)
        request = parse_chat_request(json.dumps(raw).encode())
        kinds = [part["type"] for part in chat_messages(request.messages)[0]["content"]]
        assert kinds == ["text", "video", "image_url", "video"]
        refs = video_refs(request.messages, VideoLimits(), fps=1.5, max_frames=4)
        assert [(r.index, r.fps, r.max_frames) for r in refs] == [
            (0, 1.5, 4),
            (1, 1.5, 4),
        ]

    def test_too_many_videos_names_the_first_one_over(self) -> None:
        raw = body(video_part(), video_part(), video_part())
        request = parse_chat_request(json.dumps(raw).encode())
        with pytest.raises(VideoRefusedError) as caught:
            video_refs(request.messages, VideoLimits(max_videos=2))
        assert caught.value.index == 2
        paths = [
            "messages[0].content[1].image_url",
            *(f"messages[0].content[{i}].video_url" for i in (1, 2, 3)),
        ]
        error = api_error(caught.value, retry_after=1, places=paths)
        assert error is not None
        assert error.param == "messages[0].content[3].video_url"

    def test_the_settings_make_the_limits(self) -> None:
        config = ServerConfig(max_videos=3, max_video_frames=8, video_fps=1.0)
        limits = config.video_limits
        assert (limits.max_videos, limits.max_frames, limits.fps) == (3, 8, 1.0)
        with pytest.raises(ValueError, match="max_video_frames"):
            ServerConfig(max_video_frames=1)
        with pytest.raises(ValueError, match="video_fps"):
            ServerConfig(video_fps=0.0)


def video_request(
    video: Video, max_tokens: int, text: str = "What happens here?"
) -> tuple[GenerationParams, list[Any]]:
    content = [{"type": "text", "text": text}, {"type": "video"}]
    params = GenerationParams(
        ({"role": "user", "content": content},),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        videos=(video,),
    )
    return params, []


async def run(
    batch: BatchEngine, req: tuple[GenerationParams, list[Any]]
) -> list[Event]:
    async with batch.stream(*req) as stream:
        return [event async for event in stream]


class TestEngine:
    @pytest.mark.slow
    @pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
    async def test_a_video_batched_with_others_matches_it_alone(
        self, thread: MLXThread, family: str
    ) -> None:
        loaded = await thread.run(engine.load, tiny_vlm_path(model_type=family))
        videos = [decoded(0), decoded(1, fps=4.0)]
        reqs = [
            video_request(videos[0], 12),
            video_request(videos[1], 10, "Describe it."),
        ]
        reqs += [request(i, 8 + i, top_logprobs=3) for i in range(7)]
        alone = [await run(BatchEngine(loaded, thread), req) for req in reqs]
        batch = BatchEngine(loaded, thread)
        runs = await all_at_once(thread, batch, reqs, seconds=120)
        for run_, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run_.events, expected) <= TOL
        video_final = alone[0][-1]
        assert isinstance(video_final, FinalEvent)
        assert video_final.prompt_tokens > 20  # the video's tokens are in it

    async def test_a_different_video_of_one_shape_gets_another_key(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        first, second = decoded(0), decoded(1)
        media = media_tokens(loaded)

        def key(video: Video) -> Any:
            params, images = video_request(video, 4)
            return make_row(loaded, params, images, media=media).key

        one, again, other = [await thread.run(key, v) for v in (first, first, second)]
        assert one is not None
        assert other is not None
        assert np.array_equal(one, again)
        assert len(one) == len(other)
        assert not np.array_equal(one, other)
        # Only the text before the video is the same.
        differs = np.flatnonzero(one != other)
        assert (one[differs] < 0).all()

    async def test_the_caches_never_serve_another_videos_answer(
        self, thread: MLXThread
    ) -> None:
        loaded = await thread.run(engine.load, tiny_vlm_path(model_type="qwen3_vl"))
        cached = BatchEngine(
            loaded, thread, prompt_cache_bytes=2**26, image_cache_bytes=2**26
        )
        first, second = decoded(0), decoded(1)
        await run(cached, video_request(first, 6))
        other = await run(cached, video_request(second, 6))
        fresh_loaded = await thread.run(
            engine.load, tiny_vlm_path(model_type="qwen3_vl")
        )
        expected = await run(
            BatchEngine(fresh_loaded, thread), video_request(second, 6)
        )
        assert max_logprob_difference(other, expected) <= TOL
        last = other[-1]
        assert isinstance(last, FinalEvent)
        prepared = await thread.run(preprocess, loaded, video_request(second, 6)[0], ())
        ids = prepared.inputs["input_ids"][0].tolist()
        # The text before the video at most.
        assert last.cached_tokens <= ids.index(loaded.config.video_token_id)
        again = await run(cached, video_request(first, 6))
        assert isinstance(again[-1], FinalEvent)
        assert again[-1].cached_tokens > 20  # through the video
        tower = cached.image_cache
        assert tower is not None
        # Each video's frames encoded once; the first one's served again.
        assert (tower.held.misses, tower.held.hits) == (2, 1)

    async def test_an_image_and_a_video_in_one_prompt_are_keyed_apart(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        params, _ = video_request(decoded(0), 4)
        content = [{"type": "image_url"}, *params.messages[0]["content"]]
        both = dataclasses.replace(
            params, messages=({"role": "user", "content": content},)
        )
        picture = request(0, 4)[1]
        row = await thread.run(
            make_row, loaded, both, picture, media=media_tokens(loaded)
        )
        assert row.key is not None
        assert len(set(row.key[row.key < 0].tolist())) == 2  # one hash each
        events = await run(BatchEngine(loaded, thread), (both, picture))
        assert isinstance(events[-1], FinalEvent)

    async def test_qwen2_5_vl_takes_images_or_videos_not_both(
        self, thread: MLXThread
    ) -> None:
        loaded = await thread.run(engine.load, tiny_vlm_path(model_type="qwen2_5_vl"))
        params, _ = video_request(decoded(0), 4)
        content = [{"type": "image_url"}, *params.messages[0]["content"]]
        both = dataclasses.replace(
            params, messages=({"role": "user", "content": content},)
        )
        with pytest.raises(VideoRefusedError) as caught:
            await run(BatchEngine(loaded, thread), (both, request(0, 4)[1]))
        assert caught.value.code == "mixed_media_unsupported"

    async def test_a_family_without_video_refuses_it(self, thread: MLXThread) -> None:
        loaded = await thread.run(engine.load, tiny_vlm_path(model_type="gemma3"))
        with pytest.raises(VideoRefusedError, match="takes no videos") as caught:
            await run(BatchEngine(loaded, thread), video_request(decoded(0), 4))
        assert caught.value.code == "videos_unsupported"


class TestApp:
    # The openai SDK's async streams leave generators to asyncio's finalizer.
    @pytest.mark.parametrize("anyio_backend", ["asyncio"])
    async def test_openai_sdk_streaming_and_not(self, serve: Serve) -> None:
        async with serve() as served:
            transport = CheckedTransport(httpx.ASGITransport(app=served.app))
            http = httpx.AsyncClient(transport=transport, base_url="http://test")
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="unused", http_client=http
            )
            messages: Any = body(video_part())["messages"]
            whole = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=6,
                temperature=0.0,
                extra_body={"video_fps": 2.0, "video_max_frames": 4},
            )
            assert whole.choices[0].message.content
            assert whole.usage is not None
            assert whole.usage.prompt_tokens > 20
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=6,
                temperature=0.0,
                stream=True,
            )
            async with stream:
                pieces = [
                    chunk.choices[0].delta.content or ""
                    async for chunk in stream
                    if chunk.choices
                ]
            assert "".join(pieces) == whole.choices[0].message.content
            await http.aclose()

    async def test_bad_videos_are_400s_naming_the_part_fast(self, serve: Serve) -> None:
        noise = np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8)
        bad = {
            "video_too_long": _patched_avi(CLIP, frames=10**9),
            "invalid_video": noise.tobytes(),
        }
        # Fast: refused from the container's headers, no frame decoded.
        async with serve() as served:
            for code, data in bad.items():
                with frames_read() as read:
                    response = await served.chat(body(video_part(data)))
                assert read == []
                assert_error(response, 400, "messages[0].content[1].video_url", code)
            response = await served.chat(body(video_part(), video_max_frames=64))
            assert_error(response, 400, "video_max_frames", "invalid_value")
        async with serve(max_video_pixels=1000) as served:
            with frames_read() as read:
                response = await served.chat(body(video_part()))
            assert read == []
            assert_error(
                response, 400, "messages[0].content[1].video_url", "video_too_large"
            )

    async def test_remote_videos_need_the_switch(self, serve: Serve) -> None:
        async with serve() as served:
            part = {
                "type": "video_url",
                "video_url": {"url": "https://example.com/a.mp4"},
            }
            response = await served.chat(body(part))
            assert_error(
                response,
                400,
                "messages[0].content[1].video_url",
                "remote_videos_disabled",
            )

    async def test_remote_videos_go_through_the_fetcher(self, serve: Serve) -> None:
        fetched: list[str] = []

        async def fetch(url: str) -> bytes:
            fetched.append(url)
            return CLIP

        async with serve(image_fetcher=fetch) as served:
            url = "https://example.com/a.avi"
            part = {"type": "video_url", "video_url": {"url": url}}
            response = await served.chat(body(part))
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] > 20
        assert fetched == [url]

    async def test_a_family_without_video_answers_400_naming_the_part(
        self, lifespan: Lifespan
    ) -> None:
        app = create_app(tiny_vlm_path(model_type="gemma3"), served_model_name=MODEL)
        transport = CheckedTransport(httpx.ASGITransport(app=app))
        async with (
            lifespan(app),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            response = await client.post(
                "/v1/chat/completions", json=body(video_part())
            )
        error = assert_error(
            response, 400, "messages[0].content[1].video_url", "videos_unsupported"
        )
        assert "gemma3" in error["message"]
