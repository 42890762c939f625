"""The playground: ``http/playground.py`` (its routes and their headers) and
its page, driven in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, under Selenium) against a real three-model server.

The browser tests fail on any error in the browser's console; a copy of the
page with a broken ``app.js`` shows that the check catches one.
"""

from __future__ import annotations

import base64
import os
import re
import sys
import textwrap
import time
import wave
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.select import Select
from starlette.applications import Starlette

from mlx_pinned.server.http.playground import CSP, DIRECTORY, routes
from mlx_pinned.testing import image_data_uri

from .conftest import assert_error
from .kit import Serve, Server, running

T = TypeVar("T")

# Debian's paths (.ci/run installs them); elsewhere, name them in the environment.
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
LONG = 30000  # max_tokens of an answer the test stops

# The server the browser talks to: two tiny vision models of different
# families and a tiny Gemma 4 that takes audio too (create_app, as
# `mlx-pinned serve` builds it, under uvicorn). Beside them,
# for the tests: under /broken/ the page read from another folder (the
# negative control's), and under /canned/ the page with a scripted API (the
# page's API paths are relative) whose one answer has reasoning and a tool
# call, each event split over two writes; /canned/last is the body it got.
SERVER = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import uvicorn
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Mount, Route

    from mlx_pinned.server import create_app
    from mlx_pinned.server.http.playground import routes
    from mlx_pinned.testing import tiny_omni_path, tiny_vlm_path

    broken, limit, key = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] or None
    app = create_app(
        [tiny_vlm_path("qwen3_vl"), tiny_vlm_path("qwen2_5_vl"), tiny_omni_path()],
        served_model_name=["tiny-a", "tiny-b", "tiny-omni"],
        max_tokens_limit=limit,
        api_key=key,
    )

    def chunk(delta, finish=None):
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"model": "canned", "choices": [choice]}

    call = {"index": 0, "id": "call_1", "type": "function"}
    CANNED = [
        chunk({"role": "assistant", "reasoning_content": "Let me "}),
        chunk({"reasoning_content": "think."}),
        chunk({"content": "Sunny."}),
        chunk({"tool_calls": [{**call, "function": {"name": "get_weather"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
        chunk({}, "tool_calls"),
        {"model": "canned", "choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
    ]
    last = {}

    async def models(request):
        card = {"id": "canned", "object": "model", "created": 0, "owned_by": "t"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(request):
        last.clear()
        last.update(await request.json())

        async def events():
            for event in CANNED:
                text = "data: " + json.dumps(event) + "\\r\\n\\r\\n"
                yield text[:9]
                yield text[9:]
            yield "data: [DONE]\\n\\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def seen(request):
        return JSONResponse(last)

    canned = [
        *routes(),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/last", seen),
    ]
    app.router.routes[:0] = [
        Mount("/broken", routes=routes(broken)),
        Mount("/canned", routes=canned),
    ]
    uvicorn.run(app, host="127.0.0.1", port=0)
    """
)


# ---- the routes -------------------------------------------------------------


class TestRoutes:
    pytestmark = pytest.mark.anyio

    async def test_the_page_and_its_assets_have_their_types_and_the_csp(
        self, serve: Serve
    ) -> None:
        types = {
            "/": "text/html; charset=utf-8",
            "/playground/app.js": "text/javascript; charset=utf-8",
            "/playground/style.css": "text/css; charset=utf-8",
            "/playground/icon.svg": "image/svg+xml",
        }
        async with serve() as served:
            for path, content_type in types.items():
                response = await served.client.get(path)
                assert response.status_code == 200, path
                assert response.headers["content-type"] == content_type
                assert response.headers["content-security-policy"] == CSP
                assert response.headers["x-content-type-options"] == "nosniff"
                assert response.headers["cache-control"] == "no-cache"
                assert response.headers["etag"]

    async def test_the_policy_allows_only_the_pages_own_origin(self) -> None:
        policy = dict(part.split(" ", 1) for part in CSP.split("; "))
        assert policy["default-src"] == "'none'"
        for directive in ("script-src", "style-src", "connect-src"):
            assert policy[directive] == "'self'", directive
        assert policy["object-src"] == policy["base-uri"] == "'none'"
        assert policy["frame-ancestors"] == "'none'"
        assert "'unsafe-inline'" not in CSP
        assert "'unsafe-eval'" not in CSP

    async def test_the_page_has_no_inline_script_or_style(self) -> None:
        page = (DIRECTORY / "index.html").read_text()
        assert re.findall(r"<script\b[^>]*>", page) == [
            '<script src="playground/app.js" defer>'
        ]
        assert "<style" not in page
        assert not re.search(r"\sstyle=", page)
        assert not re.search(r"\son[a-z]+=", page)  # no inline handlers
        assert "http://" not in page
        assert "https://" not in page

    async def test_an_unchanged_file_is_a_304(self, serve: Serve) -> None:
        async with serve() as served:
            first = await served.client.get("/playground/app.js")
            again = await served.client.get(
                "/playground/app.js", headers={"If-None-Match": first.headers["etag"]}
            )
            assert again.status_code == 304
            assert again.content == b""
            assert again.headers["content-security-policy"] == CSP
            other = await served.client.get(
                "/playground/app.js", headers={"If-None-Match": '"other"'}
            )
            assert other.status_code == 200
            assert other.content == first.content

    async def test_an_unknown_asset_is_a_404(self, serve: Serve) -> None:
        async with serve() as served:
            for path in (
                "/playground/nope.js",
                "/playground/index.html",  # the page is at / only
                "/playground/",
                "/playground/a/app.js",
            ):
                assert_error(await served.client.get(path), 404)
            assert_error(await served.client.post("/", content=b"{}"), 405)

    async def test_without_the_playground_its_paths_are_404(self, serve: Serve) -> None:
        async with serve(playground=False) as served:
            for path in ("/playground/app.js", "/playground/style.css"):
                assert_error(await served.client.get(path), 404)
            assert (await served.client.get("/v1/models")).status_code == 200
            # "/" is then Ollama's "is it running" (docs/ollama.md).
            assert (await served.client.get("/")).text == "Ollama is running"

    async def test_the_page_needs_no_key_while_the_api_does(self, serve: Serve) -> None:
        async with serve(api_key="s3cret") as served:
            for path in ("/", "/playground/app.js", "/playground/style.css"):
                assert (await served.client.get(path)).status_code == 200, path
            assert_error(await served.client.get("/v1/models"), 401)
            assert_error(await served.client.get("/metrics"), 401)
            assert_error(await served.client.post("/v1/chat/completions"), 401)
            assert_error(await served.client.get("/v2"), 401)
            right = {"Authorization": "Bearer s3cret"}
            listed = await served.client.get("/v1/models", headers=right)
            assert listed.status_code == 200

    async def test_the_routes_read_another_folder(self, tmp_path: Path) -> None:
        (tmp_path / "index.html").write_text("<!doctype html><title>x</title>")
        (tmp_path / "app.js").write_text("1;")
        (tmp_path / "notes.txt").write_text("not served")
        app = Starlette(routes=routes(tmp_path))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.get("/")).text == "<!doctype html><title>x</title>"
            assert (await c.get("/playground/app.js")).text == "1;"
            assert (await c.get("/playground/notes.txt")).status_code == 404
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(FileNotFoundError, match=r"no index\.html"):
            routes(empty)


# ---- the page, in a browser -------------------------------------------------


def rows(server: Server, model: str) -> int:
    """The rows ``model`` holds, as the server's health says."""
    health = httpx.get(server.url + "/health", timeout=5).json()
    return int(health["models"][model]["rows"])


@contextmanager
def serving(folder: Path, api_key: str = "") -> Iterator[Server]:
    """The test server on a free loopback port; killed at the end."""
    broken = folder / "broken"
    broken.mkdir()
    for asset in DIRECTORY.iterdir():
        (broken / asset.name).write_bytes(asset.read_bytes())
    # A broken build: app.js cut off in the middle (a syntax error).
    script = (DIRECTORY / "app.js").read_text()
    (broken / "app.js").write_text(script[: len(script) // 2])
    log = folder / "server.log"
    command = [sys.executable, "-c", SERVER, str(broken), str(LONG), api_key]
    with running(command, log) as started:
        yield started


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("playground")) as started:
        yield started


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("keyed"), api_key="s3cret") as started:
        yield started


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1100,900",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: WebDriver) -> list[str]:
    """The browser console's errors since the last call (it empties the log)."""
    log: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [entry["message"] for entry in log if entry["level"] == "SEVERE"]


def assert_no_console_errors(driver: WebDriver) -> None:
    errors = console_errors(driver)
    assert not errors, f"the browser console has errors: {errors}"


def until(check: Callable[[], T | None], what: str, timeout: float = 30) -> T:
    """``check()`` once it is truthy; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def open_page(driver: WebDriver, url: str) -> None:
    driver.get(url)
    until(lambda: driver.find_element(By.ID, "model").is_enabled(), "the model list")


def set_field(driver: WebDriver, field: str, value: str) -> None:
    element = driver.find_element(By.ID, field)
    if not element.is_displayed():  # a setting: open the settings
        driver.find_element(By.CSS_SELECTOR, ".settings summary").click()
    element.clear()
    element.send_keys(value)


def ask(driver: WebDriver, question: str, max_tokens: int) -> WebElement:
    """Sends ``question``; the new answer's element."""
    set_field(driver, "max-tokens", str(max_tokens))
    before = len(driver.find_elements(By.CSS_SELECTOR, ".turn.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(question)
    driver.find_element(By.ID, "send").click()
    turns = until(
        lambda: driver.find_elements(By.CSS_SELECTOR, ".turn.assistant")[before:],
        "the answer",
    )
    return turns[0]


def finished(answer: WebElement) -> str:
    """The answer's numbers, once it has ended."""
    return until(lambda: answer.find_element(By.CLASS_NAME, "stats").text, "the end")


def text_of(answer: WebElement) -> str:
    return str(answer.find_element(By.CLASS_NAME, "answer-text").text)


def prompt_tokens(stats: str) -> int:
    found = re.search(r"(\d+) prompt tokens", stats)
    assert found, stats
    return int(found.group(1))


@pytest.mark.slow
def test_a_conversation_in_the_browser(
    server: Server, browser: WebDriver, tmp_path: Path
) -> None:
    open_page(browser, server.url + "/")
    picker = Select(browser.find_element(By.ID, "model"))
    assert [option.text for option in picker.options] == [
        "tiny-a",
        "tiny-b",
        "tiny-omni",
    ]
    assert picker.first_selected_option.text == "tiny-a"

    # An image, attached through the file picker, shows as a preview.
    uri = image_data_uri(64, 64, seed=3)
    image = tmp_path / ("picture." + uri.split(";")[0].split("/")[1])
    image.write_bytes(base64.b64decode(uri.split(",", 1)[1]))
    browser.find_element(By.ID, "file").send_keys(str(image))
    thumb = until(
        lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments img.thumb"),
        "the preview",
    )[0]
    assert str(thumb.get_attribute("src")).startswith("blob:")
    until(lambda: thumb.get_property("naturalWidth") == 64, "the preview to load")

    first = ask(browser, "What is in this picture?", 16)
    stats = finished(first)
    assert "16 tokens · " in stats
    assert "tokens/s" in stats
    assert text_of(first)
    assert browser.find_elements(By.CSS_SELECTOR, ".turn.user img.shown")
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments li")

    # A long answer streams in pieces, then Stop closes the connection and
    # the server frees its row.
    long = ask(browser, "Tell me a very long story.", LONG)
    lengths: list[int] = []

    def grown() -> bool:
        lengths.append(len(text_of(long)))
        return len(set(lengths) - {0}) >= 2

    until(grown, "the answer to grow")
    assert not long.find_element(By.CLASS_NAME, "stats").text  # still streaming
    assert lengths == sorted(lengths)
    assert rows(server, "tiny-a") == 1
    browser.find_element(By.ID, "stop").click()
    assert "stopped" in finished(long)
    until(lambda: rows(server, "tiny-a") == 0, "the row to be freed", timeout=10)
    stopped_at = len(text_of(long))
    assert stopped_at >= lengths[-1]
    time.sleep(0.3)
    assert len(text_of(long)) == stopped_at
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_displayed()

    # The other model answers; the conversation so far goes with the question.
    picker.select_by_value("tiny-b")
    other = ask(browser, "And now?", 12)
    stats = finished(other)
    assert "12 tokens · " in stats
    assert other.find_element(By.CLASS_NAME, "who").text == "tiny-b"
    assert text_of(other)
    assert prompt_tokens(stats) > prompt_tokens(finished(first))
    assert rows(server, "tiny-b") == 0

    browser.execute_script("document.querySelector('.settings').open = false")
    shot = Path(os.environ.get("PLAYGROUND_SCREENSHOT", tmp_path / "page.png"))
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_no_console_errors(browser)


def wav_file(path: Path, seconds: float = 1.0) -> Path:
    """A WAV file of ``seconds`` of a tone at 16 kHz, written to ``path``."""
    rate = 16000
    tone = 0.3 * np.sin(np.arange(int(seconds * rate)) * 2 * np.pi * 220 / rate)
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((tone * 32767).astype("<i2").tobytes())
    return path


@pytest.mark.slow
def test_audio_attaches_for_a_model_that_takes_it(
    server: Server, browser: WebDriver, tmp_path: Path
) -> None:
    open_page(browser, server.url + "/")
    cards = httpx.get(server.url + "/v1/models", timeout=5).json()["data"]
    taken = {card["id"]: card["input_modalities"] for card in cards}
    assert taken == {
        "tiny-a": ["text", "image"],
        "tiny-b": ["text", "image"],
        "tiny-omni": ["text", "image", "audio"],
    }
    sound = wav_file(tmp_path / "question.wav")
    picker = Select(browser.find_element(By.ID, "model"))

    # A model that takes no audio: the page says so and attaches nothing.
    picker.select_by_value("tiny-a")
    browser.find_element(By.ID, "file").send_keys(str(sound))
    status = browser.find_element(By.ID, "status")
    until(lambda: "takes no audio" in status.text, "the refusal")
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments li")

    # The omni model: a player previews the file, and the model hears it.
    picker.select_by_value("tiny-omni")
    browser.find_element(By.ID, "file").send_keys(str(sound))
    player = until(
        lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments audio.thumb"),
        "the player",
    )[0]
    assert str(player.get_attribute("src")).startswith("blob:")
    heard = ask(browser, "What is said?", 8)
    with_audio = prompt_tokens(finished(heard))
    assert browser.find_elements(By.CSS_SELECTOR, ".turn.user audio.shown")
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments li")
    # A second of audio is 25 audio tokens and its two markers.
    text = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "tiny-omni",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "What is said?"}],
        },
        timeout=30,
    ).json()["usage"]["prompt_tokens"]
    assert with_audio == text + 27
    assert_no_console_errors(browser)


# Drops a PNG on the page and pastes a video into the message box, as a
# person would (the files made in the page: WebDriver cannot drag from the
# desktop).
DROP_AND_PASTE = """
const [png] = arguments;
const bytes = Uint8Array.from(atob(png), (c) => c.charCodeAt(0));
const dropped = new DataTransfer();
dropped.items.add(new File([bytes], "dropped.png", {type: "image/png"}));
document.dispatchEvent(new DragEvent("dragenter", {dataTransfer: dropped}));
document.dispatchEvent(
  new DragEvent("drop", {dataTransfer: dropped, bubbles: true, cancelable: true}));
const pasted = new DataTransfer();
pasted.items.add(new File([new Uint8Array(64)], "clip.mp4", {type: "video/mp4"}));
document.getElementById("prompt").dispatchEvent(
  new ClipboardEvent(
    "paste", {clipboardData: pasted, bubbles: true, cancelable: true}));
"""


def test_drop_and_paste_attach_with_previews(
    server: Server, browser: WebDriver
) -> None:
    open_page(browser, server.url + "/")
    png = image_data_uri(32, 32, fmt="PNG", seed=1).split(",", 1)[1]
    browser.execute_script(DROP_AND_PASTE, png)

    def attached() -> list[WebElement]:
        found = browser.find_elements(By.CSS_SELECTOR, "#attachments li")
        return found if len(found) == 2 else []

    entries = until(attached, "two attachments")
    assert entries[0].find_element(By.TAG_NAME, "img").get_attribute("alt") == (
        "dropped.png"
    )
    video = entries[1].find_element(By.TAG_NAME, "video")
    assert str(video.get_attribute("src")).startswith("blob:")
    assert not browser.find_element(By.ID, "drop").is_displayed()
    entries[0].find_element(By.CLASS_NAME, "remove").click()
    left = browser.find_elements(By.CSS_SELECTOR, "#attachments li")
    assert [entry.find_element(By.TAG_NAME, "video") for entry in left]
    left[0].find_element(By.CLASS_NAME, "remove").click()
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments li")
    assert_no_console_errors(browser)


@pytest.mark.slow
def test_reasoning_folds_and_tool_calls_show(
    server: Server, browser: WebDriver
) -> None:
    open_page(browser, server.url + "/canned/")
    answer = ask(browser, "Weather in Paris?", 64)
    assert "7 tokens · " in finished(answer)
    assert "tool_calls" in finished(answer)
    assert text_of(answer) == "Sunny."
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.is_displayed()
    assert reasoning.get_attribute("open") is None  # folded
    assert not answer.find_element(By.CLASS_NAME, "reasoning-text").is_displayed()
    reasoning.find_element(By.TAG_NAME, "summary").click()
    assert answer.find_element(By.CLASS_NAME, "reasoning-text").text == (
        "Let me think."
    )
    assert answer.find_element(By.CLASS_NAME, "tool-name").text == (
        "tool call: get_weather"
    )
    arguments = answer.find_element(By.CLASS_NAME, "tool-arguments").text
    assert arguments == '{"city": "Paris"}'

    # The next question carries the turn: the answer and its tool call, not
    # its reasoning.
    finished(ask(browser, "Thanks.", 8))
    sent = httpx.get(server.url + "/canned/last").json()
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["max_tokens"] == 8
    assert sent["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Sunny.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "user", "content": "Thanks."},
    ]
    assert_no_console_errors(browser)


def test_the_page_fits_a_phone(server: Server, browser: WebDriver) -> None:
    phone = {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", phone)
    try:
        open_page(browser, server.url + "/")
        scrolled, shown = browser.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth]"
        )
        assert shown == 390
        assert scrolled <= shown, (scrolled, shown)
        for control in ("model", "prompt", "send", "file"):
            box = browser.find_element(By.ID, control).rect
            assert box["x"] >= 0, control
            assert box["x"] + box["width"] <= shown, control
        assert_no_console_errors(browser)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_the_console_check_catches_a_broken_page(
    server: Server, browser: WebDriver
) -> None:
    console_errors(browser)  # empty the log
    browser.get(server.url + "/broken/")
    until(
        lambda: browser.execute_script("return document.readyState") == "complete",
        "the page",
    )
    # The broken script never ran: the picker still waits for its models.
    assert not browser.find_element(By.ID, "model").is_enabled()
    with pytest.raises(AssertionError, match="the browser console has errors") as e:
        assert_no_console_errors(browser)
    assert "app.js" in str(e.value)
    assert "SyntaxError" in str(e.value)


@pytest.mark.slow
def test_the_page_asks_for_the_key_and_sends_it(
    keyed_server: Server, browser: WebDriver
) -> None:
    console_errors(browser)
    browser.get(keyed_server.url + "/")
    box = browser.find_element(By.ID, "key-box")
    until(box.is_displayed, "the key field")
    # The 401 of /v1/models is the one error the console shows.
    errors = until(lambda: console_errors(browser), "the 401 in the console")
    assert all("401" in error for error in errors), errors
    set_field(browser, "api-key", "s3cret")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    until(lambda: browser.find_element(By.ID, "model").is_enabled(), "the models")
    assert not box.is_displayed()
    answer = ask(browser, "Hello?", 4)
    assert "4 tokens · " in finished(answer)
    assert_no_console_errors(browser)
    browser.execute_script("sessionStorage.clear()")
