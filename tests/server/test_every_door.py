"""One answer, every door: the same greedy prompt through chat completions,
the Responses API, Anthropic Messages and the legacy completions (the chat's
rendering as token ids from ``/tokenize``) gives the same tokens; sixteen
requests spread over the four doors in one batch each equal their solo answer.
The vision model (Qwen3-VL) and a text model (Qwen3) alike, in-process; and
the official ``openai`` and ``anthropic`` clients against a real server.

Completions takes token ids, not images (an image placeholder in a prompt is
refused), so a prompt with an image goes through the other three doors."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from mlx_pinned.server import create_app
from mlx_pinned.server.cli import DEMO_MODEL_NAME
from mlx_pinned.testing import image_data_uri, tiny_lm_path

from .conftest import MODEL
from .kit import Lifespan, Serve, Served, Server, in_process, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

TOL = 1e-5
MAX_TOKENS = 32
DOORS = ("chat", "responses", "messages", "completions")
SYSTEM = "You answer briefly."


@dataclass(frozen=True)
class Prompt:
    """A system prompt, a user's text and, optionally, an image's seed."""

    text: str
    image_seed: int | None = None
    system: str | None = SYSTEM


@dataclass
class Answer:
    """What a door answered: the text, the token counts, and the tokens'
    log-probabilities where the door returns them."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None


def chat_messages(prompt: Prompt) -> list[dict[str, Any]]:
    content: Any = prompt.text
    if prompt.image_seed is not None:
        url = image_data_uri(64, 64, seed=prompt.image_seed)
        content = [
            {"type": "text", "text": prompt.text},
            {"type": "image_url", "image_url": {"url": url}},
        ]
    messages = [{"role": "user", "content": content}]
    if prompt.system is not None:
        messages.insert(0, {"role": "system", "content": prompt.system})
    return messages


async def ask_chat(served: Served, prompt: Prompt) -> Answer:
    body = {
        "model": MODEL,
        "messages": chat_messages(prompt),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
    }
    answer = await served.client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    (choice,) = data["choices"]
    return Answer(
        choice["message"]["content"],
        data["usage"]["prompt_tokens"],
        data["usage"]["completion_tokens"],
        [t["logprob"] for t in choice["logprobs"]["content"]],
    )


async def ask_responses(served: Served, prompt: Prompt) -> Answer:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": prompt.text}]
    if prompt.image_seed is not None:
        url = image_data_uri(64, 64, seed=prompt.image_seed)
        content.append({"type": "input_image", "image_url": url})
    body: dict[str, Any] = {
        "model": MODEL,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "store": False,
    }
    if prompt.system is not None:
        body["instructions"] = prompt.system
    answer = await served.client.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    texts = [
        part["text"]
        for item in data["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    return Answer(
        "".join(texts),
        data["usage"]["input_tokens"],
        data["usage"]["output_tokens"],
        None,
    )


async def ask_messages(served: Served, prompt: Prompt) -> Answer:
    content: list[dict[str, Any]] = [{"type": "text", "text": prompt.text}]
    if prompt.image_seed is not None:
        url = image_data_uri(64, 64, seed=prompt.image_seed)
        media, data = url.removeprefix("data:").split(";base64,", 1)
        source = {"type": "base64", "media_type": media, "data": data}
        # The chat's order: the text, then the image.
        content.append({"type": "image", "source": source})
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if prompt.system is not None:
        body["system"] = prompt.system
    answer = await served.client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    message = answer.json()
    texts = [block["text"] for block in message["content"] if block["type"] == "text"]
    return Answer(
        "".join(texts),
        message["usage"]["input_tokens"],
        message["usage"]["output_tokens"],
        None,
    )


async def ask_completions(served: Served, prompt: Prompt) -> Answer:
    assert prompt.image_seed is None, "completions take no images"
    rendered = await served.client.post(
        "/tokenize", json={"model": MODEL, "messages": chat_messages(prompt)}
    )
    assert rendered.status_code == 200, rendered.text
    body = {
        "model": MODEL,
        "prompt": rendered.json()["tokens"],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
    }
    answer = await served.client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    (choice,) = data["choices"]
    return Answer(
        choice["text"],
        data["usage"]["prompt_tokens"],
        data["usage"]["completion_tokens"],
        choice["logprobs"]["token_logprobs"],
    )


ASK = {
    "chat": ask_chat,
    "responses": ask_responses,
    "messages": ask_messages,
    "completions": ask_completions,
}


def doors_for(prompt: Prompt) -> tuple[str, ...]:
    return DOORS if prompt.image_seed is None else DOORS[:3]


def difference(a: list[float] | None, b: list[float] | None) -> float:
    assert a is not None
    assert b is not None
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def assert_same(got: Answer, expected: Answer, door: str) -> None:
    assert got.text == expected.text, door
    assert got.prompt_tokens == expected.prompt_tokens, door
    assert got.completion_tokens == expected.completion_tokens, door
    if got.logprobs is not None and expected.logprobs is not None:
        assert difference(got.logprobs, expected.logprobs) <= TOL, door


TEXT = Prompt("Tell me about the sea.")
IMAGE = Prompt("Describe this image in one sentence.", image_seed=3)


@asynccontextmanager
async def text_model(lifespan: Lifespan) -> AsyncIterator[Served]:
    """The tiny text model (Qwen3), in-process, a batch of one."""
    app = create_app(tiny_lm_path(), served_model_name=MODEL, max_num_seqs=1)
    async with in_process(app, lifespan, Served) as served:
        yield served


@pytest.mark.parametrize(
    ("model", "prompt"),
    [("vlm", TEXT), ("vlm", IMAGE), ("lm", TEXT)],
    ids=["vlm-text", "vlm-image", "lm-text"],
)
async def test_every_door_gives_the_same_answer(
    serve: Serve, lifespan: Lifespan, model: str, prompt: Prompt
) -> None:
    served_model = serve() if model == "vlm" else text_model(lifespan)
    async with served_model as served:
        answers = {door: await ASK[door](served, prompt) for door in doors_for(prompt)}
    chat = answers["chat"]
    assert chat.completion_tokens == MAX_TOKENS  # something to compare
    assert chat.logprobs is not None
    assert len(chat.logprobs) == MAX_TOKENS
    for door, answer in answers.items():
        assert_same(answer, chat, door)
    if "completions" in answers:
        most = difference(answers["completions"].logprobs, chat.logprobs)
        print(f"{prompt.text!r}: completions against chat, most {most:.2e}")


@pytest.mark.slow
def test_the_sdks_get_the_same_answer_from_a_real_server(
    tmp_path: Path,
) -> None:
    """The official clients, ``openai`` and ``anthropic``, against ``serve
    --demo`` on a port: the image prompt through the three doors that take
    images, the text prompt through all four."""
    with running_server(tmp_path / "server.log") as server:
        client = server.client()
        claude = server.anthropic_client()
        for prompt in (TEXT, IMAGE):
            answers = sdk_answers(server, client, claude, prompt)
            chat = answers["chat"]
            assert chat.completion_tokens == MAX_TOKENS
            for door, answer in answers.items():
                assert_same(answer, chat, door)
            assert set(answers) == set(doors_for(prompt))
        log = server.log_text()
    assert " 200" in log
    assert not re.search(r'" [45]\d\d', log), log


def sdk_answers(
    server: Server,
    client: openai.OpenAI,
    claude: anthropic.Anthropic,
    prompt: Prompt,
) -> dict[str, Answer]:
    model = DEMO_MODEL_NAME
    messages: Any = chat_messages(prompt)
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
    )
    assert chat.usage is not None
    assert chat.choices[0].logprobs is not None
    answers = {
        "chat": Answer(
            chat.choices[0].message.content or "",
            chat.usage.prompt_tokens,
            chat.usage.completion_tokens,
            [t.logprob for t in chat.choices[0].logprobs.content or []],
        )
    }
    content: Any = [{"type": "input_text", "text": prompt.text}]
    blocks: Any = [{"type": "text", "text": prompt.text}]
    if prompt.image_seed is not None:
        url = image_data_uri(64, 64, seed=prompt.image_seed)
        content.append({"type": "input_image", "image_url": url, "detail": "auto"})
        media, data = url.removeprefix("data:").split(";base64,", 1)
        source = {"type": "base64", "media_type": media, "data": data}
        blocks.append({"type": "image", "source": source})
    response = client.responses.create(
        model=model,
        input=[{"role": "user", "content": content}],
        instructions=prompt.system,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
    )
    assert response.usage is not None
    answers["responses"] = Answer(
        response.output_text,
        response.usage.input_tokens,
        response.usage.output_tokens,
        None,
    )
    message = claude.messages.create(
        model=model,
        system=prompt.system or anthropic.omit,
        messages=[{"role": "user", "content": blocks}],
        max_tokens=MAX_TOKENS,
        # This SDK's create() takes no temperature; the wire field stays.
        extra_body={"temperature": 0},
    )
    answers["messages"] = Answer(
        "".join(b.text for b in message.content if b.type == "text"),
        message.usage.input_tokens,
        message.usage.output_tokens,
        None,
    )
    if prompt.image_seed is None:
        rendered = httpx.post(
            f"{server.url}/tokenize",
            json={"model": model, "messages": messages},
            timeout=60,
        )
        assert rendered.status_code == 200, rendered.text
        completion = client.completions.create(
            model=model,
            prompt=rendered.json()["tokens"],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=1,
        )
        assert completion.usage is not None
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        answers["completions"] = Answer(
            completion.choices[0].text,
            completion.usage.prompt_tokens,
            completion.usage.completion_tokens,
            [float(x) for x in logprobs.token_logprobs or []],
        )
    return answers


# Four prompts a door, each different: two with an image for the three doors
# that take one, and no system prompt for some.
CONCURRENT = [
    Prompt("Tell me about the sea."),
    Prompt("Name three colours.", system=None),
    Prompt("Describe this image in one sentence.", image_seed=1),
    Prompt("What is in this picture?", image_seed=2, system=None),
    Prompt("Count to five."),
    Prompt("Why is the sky blue?", system=None),
    Prompt("What shape is this?", image_seed=4),
    Prompt("Say something about the light.", image_seed=5, system=None),
    Prompt("Write a haiku about rain."),
    Prompt("What is a river?", system=None),
    Prompt("Is this picture dark?", image_seed=6),
    Prompt("Tell me a story.", system="You are a storyteller."),
    Prompt("Give me a word."),
    Prompt("What is two plus two?", system=None),
    Prompt("Which animal is the fastest?", system="Answer in one word."),
    Prompt("Describe the wind."),
]


def spread() -> list[tuple[str, Prompt]]:
    """Sixteen requests, four a door; the completions door gets text."""
    images = [p for p in CONCURRENT if p.image_seed is not None]
    texts = [p for p in CONCURRENT if p.image_seed is None]
    plan = [("completions", texts.pop(0)) for _ in range(4)]
    rest = images + texts
    plan += [(DOORS[i % 3], prompt) for i, prompt in enumerate(rest)]
    return plan


@pytest.mark.slow
async def test_sixteen_at_once_over_four_doors_each_equal_alone(serve: Serve) -> None:
    plan = spread()
    assert len(plan) == 16
    assert {door: sum(d == door for d, _ in plan) for door in DOORS} == dict.fromkeys(
        DOORS, 4
    )
    async with serve(max_num_seqs=16) as served:
        alone = [await ASK[door](served, prompt) for door, prompt in plan]
        assert served.engine.statistics().peak_active == 1
        together: dict[int, Answer] = {}

        async def send(index: int) -> None:
            door, prompt = plan[index]
            together[index] = await ASK[door](served, prompt)

        async with anyio.create_task_group() as group:
            for index in range(len(plan)):
                group.start_soon(send, index)
        peak = served.engine.statistics().peak_active
    # Thirteen rows in one step hold requests from all four doors (four
    # a door); all sixteen is the usual count, short of it when the host
    # is slow to send them.
    assert peak >= 13, peak
    most = dict.fromkeys(("chat", "completions"), 0.0)
    for index, (door, _prompt) in enumerate(plan):
        assert_same(together[index], alone[index], door)
        if door in most:
            gap = difference(together[index].logprobs, alone[index].logprobs)
            most[door] = max(most[door], gap)
    print(f"batched against alone, most logprob difference: {most}, peak {peak}")
