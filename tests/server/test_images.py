from __future__ import annotations

import base64
import io
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from PIL import Image, ImageFile

from mlx_pinned.server.config import ImageLimits
from mlx_pinned.server.failures import ImageRefusedError
from mlx_pinned.server.http.chat_completions.messages import image_parts
from mlx_pinned.server.http.chat_completions.messages import (
    image_refs as collect_image_refs,
)
from mlx_pinned.server.http.chat_completions.protocol import parse_chat_request
from mlx_pinned.server.http.errors import api_error
from mlx_pinned.server.inputs.images import decode_image, load_images
from mlx_pinned.server.media import ImageRef

from .conftest import AtOnce
from .kit import png_header

LIMITS = ImageLimits()
PARAM = "messages[1].content[2].image_url"


def encode(image: Image.Image, fmt: str, **save: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def ref(url: str) -> ImageRef:
    return ImageRef(index=2, url=url)


RED = Image.new("RGB", (20, 10), (255, 0, 0))


class TestDecode:
    @pytest.mark.parametrize(
        ("fmt", "mime"),
        [
            ("PNG", "image/png"),
            ("JPEG", "image/jpeg"),
            ("WEBP", "image/webp"),
            ("GIF", "image/gif"),
        ],
    )
    def test_formats_decode_to_rgb(self, fmt: str, mime: str) -> None:
        image = decode_image(ref(data_uri(encode(RED, fmt), mime)), LIMITS)
        assert image.mode == "RGB"
        assert image.size == (20, 10)
        red, green, _ = image.getpixel((5, 5))  # type: ignore[misc]
        assert red > 200
        assert green < 60

    def test_gif_first_frame(self) -> None:
        frames = [Image.new("RGB", (8, 8), c) for c in ((0, 0, 255), (255, 0, 0))]
        data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
        image = decode_image(ref(data_uri(data, "image/gif")), LIMITS)
        assert image.getpixel((1, 1)) == (0, 0, 255)

    def test_transparency_becomes_white(self) -> None:
        clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
        image = decode_image(ref(data_uri(encode(clear, "PNG"))), LIMITS)
        assert image.getpixel((0, 0)) == (255, 255, 255)

    def test_palette_with_transparency(self) -> None:
        palette = Image.new("P", (4, 4), 0)
        palette.info["transparency"] = 0
        image = decode_image(
            ref(data_uri(encode(palette, "PNG", transparency=0))), LIMITS
        )
        assert image.mode == "RGB"

    def test_mislabelled_supported_format_is_accepted(self) -> None:
        image = decode_image(ref(data_uri(encode(RED, "JPEG"), "image/png")), LIMITS)
        assert image.size == (20, 10)

    def test_base64_with_line_breaks(self) -> None:
        encoded = base64.encodebytes(encode(RED, "PNG")).decode()
        image = decode_image(ref(f"data:image/png;base64,{encoded}"), LIMITS)
        assert image.size == (20, 10)

    def test_scheme_is_case_insensitive_and_spaces_around_are_dropped(self) -> None:
        encoded = base64.b64encode(encode(RED, "PNG")).decode()
        for url in (
            f"DATA:image/PNG;BASE64,{encoded}",
            f"  data:image/png;base64,{encoded} ",
        ):
            assert decode_image(ref(url), LIMITS).size == (20, 10)

    def test_image_is_fully_loaded(self) -> None:
        image = decode_image(ref(data_uri(encode(RED, "PNG"))), LIMITS)
        # A lazily opened image would still hold its file object.
        assert getattr(image, "fp", None) is None


REFUSED = [
    ("file:///etc/passwd", "invalid_image_url", "local files are never read"),
    ("/etc/passwd", "invalid_image_url", "local files are never read"),
    ("ftp://host/x.png", "invalid_image_url", "only data: URIs"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image_format", "text/plain"),
    ("data:;base64,aGVsbG8=", "invalid_image_format", "(none)"),
    ("data:image/bmp;base64,aGVsbG8=", "invalid_image_format", "image/bmp"),
    ("data:image/png,rawbytes", "invalid_base64", "base64-encoded"),
    ("data:image/png;base64,@@@@", "invalid_base64", "not valid base64"),
    ("data:image/png;base64,aGVsbG8", "invalid_base64", "not valid base64"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "invalid_image", "not a PNG"),
]


class TestRefusals:
    @pytest.mark.parametrize(("url", "code", "text"), REFUSED)
    def test_refused_with_part_named(self, url: str, code: str, text: str) -> None:
        with pytest.raises(ImageRefusedError) as info:
            decode_image(ref(url), LIMITS)
        error = info.value
        assert error.code == code
        assert text in error.message
        assert error.index == 2
        where = ["messages[0].content[0].image_url"] * 2
        answer = api_error(error, retry_after=1, places=[*where, PARAM])
        assert answer is not None
        assert answer.status == 400
        assert (answer.param, answer.code) == (PARAM, code)
        assert answer.message == f"Invalid image at '{PARAM}': {error.message}"

    def test_truncated_file(self) -> None:
        data = encode(Image.effect_noise((64, 64), 50).convert("RGB"), "PNG")
        with pytest.raises(ImageRefusedError) as info:
            decode_image(ref(data_uri(data[: len(data) // 2])), LIMITS)
        assert info.value.code == "invalid_image"
        assert "truncated or corrupt" in info.value.message

    def test_bmp_bytes_are_not_decoded(self) -> None:
        # Only the documented formats: a real BMP labelled as PNG is refused.
        with pytest.raises(ImageRefusedError) as info:
            decode_image(ref(data_uri(encode(RED, "BMP"))), LIMITS)
        assert info.value.code == "invalid_image"

    def test_encoded_size_limit_before_decoding(self) -> None:
        limits = ImageLimits(max_bytes=1000)
        url = "data:image/png;base64," + "A" * 100_000
        with pytest.raises(ImageRefusedError) as info:
            decode_image(ref(url), limits)
        assert info.value.code == "image_too_large"
        assert "at most 1000" in info.value.message

    @pytest.mark.parametrize(
        ("size", "limit"), [((5000, 5000), 4096 * 4096), ((50_000, 50_000), 10**6)]
    )
    def test_pixel_limit_from_header(
        self, size: tuple[int, int], limit: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        data = png_header(*size)
        assert len(data) < 200
        loads: list[Image.Image] = []
        load = ImageFile.ImageFile.load

        def counted(image: ImageFile.ImageFile) -> Any:
            loads.append(image)
            return load(image)

        monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
        with pytest.raises(ImageRefusedError) as info:
            decode_image(ref(data_uri(data)), ImageLimits(max_pixels=limit))
        assert info.value.code == "image_too_large"
        assert loads == []  # refused from the header: no pixel decoded

    @pytest.mark.parametrize("size", [(201, 1), (1, 300), (2, 1000)])
    def test_sides_over_200_to_1_are_refused(self, size: tuple[int, int]) -> None:
        # Qwen-VL's processor raises on them in the middle of the request.
        with pytest.raises(ImageRefusedError) as info:
            decode_image(ref(data_uri(encode(Image.new("RGB", size), "PNG"))), LIMITS)
        assert info.value.code == "invalid_image"
        assert f"{size[0]}x{size[1]}" in info.value.message
        assert "200 times" in info.value.message

    def test_sides_at_200_to_1_are_allowed(self) -> None:
        data = encode(Image.new("RGB", (400, 2)), "PNG")
        assert decode_image(ref(data_uri(data)), LIMITS).size == (400, 2)

    def test_pixels_exactly_at_limit_are_allowed(self) -> None:
        data = encode(Image.new("RGB", (10, 10)), "PNG")
        assert decode_image(ref(data_uri(data)), ImageLimits(max_pixels=100)).size == (
            10,
            10,
        )
        with pytest.raises(ImageRefusedError):
            decode_image(ref(data_uri(data)), ImageLimits(max_pixels=99))


def request_with(*contents: list[dict[str, Any]] | str) -> Any:
    import json

    messages = [{"role": "user", "content": c} for c in contents]
    return parse_chat_request(json.dumps({"model": "m", "messages": messages}).encode())


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


class TestCollect:
    def test_refs_in_prompt_order(self) -> None:
        request = request_with(
            [image_part("data:a"), {"type": "text", "text": "x"}, image_part("data:b")],
            "text only",
            [{"type": "text", "text": "y"}, image_part("data:c")],
        )
        refs = collect_image_refs(request.messages, LIMITS)
        assert [(r.index, r.url) for r in refs] == [
            (0, "data:a"),
            (1, "data:b"),
            (2, "data:c"),
        ]
        assert [where for where, _ in image_parts(request.messages)] == [
            "messages[0].content[0].image_url",
            "messages[0].content[2].image_url",
            "messages[2].content[1].image_url",
        ]

    def test_count_limit_names_first_extra_part(self) -> None:
        request = request_with([image_part("data:a")] * 3)
        with pytest.raises(ImageRefusedError) as info:
            collect_image_refs(request.messages, ImageLimits(max_images=2))
        assert info.value.index == 2
        assert info.value.code == "too_many_images"
        assert "too many images: 3" in info.value.message


class TestLoadImages:
    @pytest.mark.anyio
    async def test_decodes_off_the_calling_thread(self) -> None:

        seen: list[int] = []
        original = Image.Image.convert

        def spy(self: Image.Image, *args: Any, **kwargs: Any) -> Image.Image:
            seen.append(threading.get_ident())
            return original(self, *args, **kwargs)

        refs = [ref(data_uri(encode(RED.convert("L"), "PNG")))] * 2
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Image.Image, "convert", spy)
            images = await load_images(refs, LIMITS)
        assert [i.size for i in images] == [(20, 10), (20, 10)]
        assert seen
        assert threading.get_ident() not in seen

    @pytest.mark.anyio
    async def test_remote_urls_refused_by_default(self) -> None:
        with pytest.raises(ImageRefusedError) as info:
            await load_images([ref("https://example.com/cat.png")], LIMITS)
        assert info.value.code == "remote_images_disabled"
        assert "not enabled" in info.value.message

    @pytest.mark.anyio
    async def test_remote_urls_use_the_fetcher(self) -> None:
        fetched: list[str] = []

        async def fetch(url: str) -> bytes:
            fetched.append(url)
            await anyio.lowlevel.checkpoint()
            return encode(RED, "PNG")

        images = await load_images([ref("http://x/y.png")], LIMITS, fetch=fetch)
        assert fetched == ["http://x/y.png"]
        assert images[0].size == (20, 10)

    @pytest.mark.anyio
    async def test_the_limiter_bounds_decodes_at_once(self) -> None:
        # Eight requests decode at once through a limiter of two: never more
        # than two decode together, and every one gets its images.
        converts = AtOnce(0.02, meet=2)
        refs = [ref(data_uri(encode(RED.convert("L"), "PNG")))]  # converted
        limiter = anyio.CapacityLimiter(2)
        results: list[list[Image.Image]] = []

        async def one() -> None:
            results.append(await load_images(refs, LIMITS, limiter=limiter))

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Image.Image, "convert", converts.wrap(Image.Image.convert))
            async with anyio.create_task_group() as group:
                for _ in range(8):
                    group.start_soon(one)
        assert converts.most == 2
        assert [r[0].size for r in results] == [(20, 10)] * 8

    @pytest.mark.anyio
    async def test_no_images_no_thread(self) -> None:
        assert await load_images([], LIMITS) == []
