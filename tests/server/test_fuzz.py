"""Hypothesis fuzzing of ``POST /v1/chat/completions`` through the real app.

Bodies range from valid-shaped requests (every field, with values in and out
of range, and images good, broken, huge or hostile) to arbitrary JSON and
arbitrary bytes. For each one the server must answer within a deadline,
never with a 5xx; an error is always in OpenAI's shape, and a 200 is a
well-formed completion or stream. One app serves every example of a test,
on asyncio and on trio, as a real server would.

``HYPOTHESIS_PROFILE=nightly`` runs many more examples (see tests/conftest.py).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from mlx_pinned.server import ImageLimits
from mlx_pinned.server.http.chat_completions.bodies import (
    ChatCompletion,
    ChatCompletionChunk,
)
from mlx_pinned.testing import make_test_image

from .conftest import MODEL, sse_events
from .kit import Serve, Served, png_header

# The CI profile runs this many examples per test and backend; nightly more.
EXAMPLES = max(settings().max_examples, 100)

# A valid example takes up to ~50 ms: give big profiles the time they need.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(max(120, EXAMPLES * 0.3))]

FUZZ = settings(
    max_examples=EXAMPLES,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one app for every example: wanted
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
LIMITS = ImageLimits(max_images=3, max_bytes=64 * 1024, max_pixels=256 * 256)


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


_PNG = make_test_image(16, 16, fmt="PNG")
GOOD_IMAGES = [
    _uri(_PNG),
    _uri(make_test_image(24, 20, fmt="JPEG", seed=1), "image/jpeg"),
    _uri(make_test_image(20, 12, fmt="WEBP", seed=2), "image/webp"),
    _uri(make_test_image(8, 8, fmt="GIF", seed=3), "image/gif"),
    _uri(make_test_image(16, 16, fmt="JPEG"), "image/png"),  # mislabelled: fine
]
BAD_IMAGES = [
    "data:image/png;base64,!!!!",
    "data:image/png;base64," + "A" * 7,  # bad padding
    _uri(b"not an image at all"),
    _uri(_PNG[: len(_PNG) // 2]),  # truncated
    _uri(png_header(50_000, 50_000)),  # a bomb, by its header
    _uri(png_header(300, 300)),  # over max_pixels
    _uri(b"\0" * (LIMITS.max_bytes + 1)),  # over max_bytes
    _uri(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
    "data:image/png,not-base64",
    "data:,hello",
    "data:image/png;base64,ü",
    "file:///etc/passwd",
    "/etc/passwd",
    "../../etc/passwd",
    "http://127.0.0.1:1/cat.png",
    "https://169.254.169.254/latest/meta-data/",
    "gopher://x",
    " ",
]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
junk = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
numbers = (
    st.integers(min_value=-3, max_value=12)
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
)
text = st.text(max_size=40) | st.sampled_from(["", "Describe it.", "\u202e\x00\ud7ff"])

# Valid requests: every field in range, images mostly good.
good_url = st.sampled_from(GOOD_IMAGES) | st.sampled_from(BAD_IMAGES)
image_part = st.fixed_dictionaries(
    {
        "type": st.just("image_url"),
        "image_url": st.fixed_dictionaries(
            {"url": good_url},
            optional={"detail": st.sampled_from(["auto", "low", "high"])},
        )
        | good_url,
    }
)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
user = st.fixed_dictionaries(
    {
        "role": st.just("user"),
        "content": text | st.lists(text_part | image_part, min_size=1, max_size=4),
    },
    optional={"name": st.text(max_size=8)},
)
other = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "assistant"]),
        "content": text | st.lists(text_part, max_size=2),
    }
)
valid_bodies = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(other | user, min_size=1, max_size=3),
    },
    optional={
        "max_tokens": st.integers(1, 6),
        "max_completion_tokens": st.integers(1, 6),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": text.filter(bool) | st.lists(text.filter(bool), max_size=4),
        "logit_bias": st.dictionaries(
            st.integers(0, 383).map(str), st.floats(-100, 100), max_size=3
        ),
        "n": st.just(1),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans()}
        ),
        "user": st.text(max_size=8),
    },
)


@st.composite
def logprobs(draw: st.DrawFn, bodies: st.SearchStrategy[dict[str, Any]]) -> Any:
    body = draw(bodies)
    body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 20))
    return body


@st.composite
def hostile(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with one or two values swapped for junk or out of range."""
    body: dict[str, Any] = draw(logprobs(valid_bodies))
    for _ in range(draw(st.integers(1, 2))):
        keys = [*body, "max_tokens", "temperature", "top_logprobs", "messages"]
        key = draw(st.sampled_from(keys))
        body[key] = draw(numbers | junk | text)
        if key == "messages" and draw(st.booleans()):
            message = draw(st.dictionaries(st.text(max_size=8), junk, max_size=3))
            body["messages"] = [message | {"role": draw(st.sampled_from(["user", 1]))}]
    return body


@pytest.fixture
async def fuzzed(serve: Serve, request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """One small app for every example of a test: short generations, small
    images, a tight deadline so that a hang fails fast. The unbatched engine
    unless the test asks for ``max_num_seqs`` (indirect parameter)."""
    async with serve(
        max_num_seqs=getattr(request, "param", 1),
        max_tokens_limit=6,
        default_max_tokens=3,
        max_body_bytes=512 * 1024,
        image_limits=LIMITS,
        request_timeout=20,
    ) as served:
        yield served


async def post(served: Served, content: bytes) -> httpx.Response:
    with anyio.fail_after(30):  # never a hang
        return await served.client.post(
            "/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
        )


def check(response: httpx.Response, streamed: bool | None = None) -> None:
    """Never a 5xx; errors in OpenAI's shape; a 200 is a whole answer, a
    stream if ``streamed`` (None: either)."""
    status = response.status_code
    assert status < 500, response.text
    if status != 200:
        event(f"{status} {response.json()['error']['code']}")
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str)
        assert error["message"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] is None or isinstance(error["param"], str)
        return
    is_stream = response.headers["content-type"].startswith("text/event-stream")
    assert streamed in (None, is_stream)
    event(f"200 {'stream' if is_stream else 'completion'}")
    if not is_stream:
        completion = ChatCompletion.model_validate_json(response.content)
        assert completion.choices[0].finish_reason in ("stop", "length")
        usage = completion.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens <= 6
        return
    events = sse_events(response.text)
    assert events[-1] == "[DONE]", events[-3:]
    for chunk in events[:-1]:
        assert "error" not in chunk, chunk
        ChatCompletionChunk.model_validate(chunk)


# Both engines: one generation at a time, and continuous batching (the CLI's
# default), which prefills, samples and detokenizes on its own path.
@pytest.mark.slow
@pytest.mark.parametrize("fuzzed", [1, 32], indirect=True, ids=["serial", "batched"])
@given(body=logprobs(valid_bodies))
@FUZZ
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
async def test_valid_bodies(fuzzed: Served, body: dict[str, Any]) -> None:
    raw = json.dumps(body, ensure_ascii=bool(len(str(body)) % 2)).encode()
    check(await post(fuzzed, raw), streamed=body.get("stream") is True)


@pytest.mark.slow
@given(body=hostile())
@FUZZ
async def test_hostile_bodies(fuzzed: Served, body: dict[str, Any]) -> None:
    raw = json.dumps(body, ensure_ascii=bool(len(str(body)) % 2)).encode()
    check(await post(fuzzed, raw), streamed=body.get("stream") is True)


@given(body=junk)
@FUZZ
async def test_any_json(fuzzed: Served, body: Any) -> None:
    check(await post(fuzzed, json.dumps(body).encode()))


hostile_json = st.sampled_from(
    [
        b"",
        b"{",
        b"[" * 5000 + b"]" * 5000,  # deep nesting
        b'{"model": "tiny", "messages": [' + b"{}," * 5000 + b"{}]}",
        b'{"model": "tiny", "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"model": "tiny", "temperature": NaN, "messages": []}',
        b'{"model": "tiny", "temperature": Infinity, "messages": []}',
        b'{"model": "\xff\xfe", "messages": []}',
        b'{"model": "tiny", "model": 1}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}], "model": "tiny"}',
        b"\xef\xbb\xbf{}",
        b"null",
    ]
)


@given(raw=st.binary(max_size=200) | hostile_json)
@FUZZ
async def test_any_bytes(fuzzed: Served, raw: bytes) -> None:
    check(await post(fuzzed, raw))


@given(body=valid_bodies, cut=st.floats(min_value=0, max_value=1))
@FUZZ
async def test_truncated_bodies(
    fuzzed: Served, body: dict[str, Any], cut: float
) -> None:
    raw = json.dumps(body).encode()
    check(await post(fuzzed, raw[: math.floor(len(raw) * cut)]))
