"""The tiny families whose real templates write a tool-call format
(``TINY_TOOL_LM_TYPES``): each is detected as its format, batches exactly,
and through ``/v1/chat/completions`` a forced call comes back in its own
syntax, parsed to arguments that validate, streamed as whole, with no
markup in any content."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai.types.chat import ChatCompletionChunk

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.model_inputs import build_prompt
from mlx_pinned.server.formats import model_formats
from mlx_pinned.server.http.chat_completions.messages import chat_messages
from mlx_pinned.server.http.chat_completions.protocol import ChatCompletionRequest
from mlx_pinned.server.http.served_models import BatchGate
from mlx_pinned.testing import TINY_TOOL_LM_TYPES, tiny_lm_path

from .conftest import MODEL, sse_events
from .kit import (
    CLOCK,
    TOL,
    WEATHER,
    Collector,
    Serve,
    Served,
    all_at_once,
    assert_no_markup,
    deadline,
    join_chat_chunks,
    max_logprob_difference,
    solo,
)
from .kit import request as batching_request

pytestmark = pytest.mark.anyio


# Each family's tool-call and reasoning formats, as the registry names them.
FORMATS = {
    "llama3_tools": {"tool_calls": "llama3_json", "reasoning": None},
    "mistral_tools": {"tool_calls": "mistral", "reasoning": None},
    "gpt_oss_harmony": {"tool_calls": "harmony", "reasoning": "harmony"},
    "qwen3_coder": {"tool_calls": "qwen3_coder", "reasoning": None},
}
# The families whose call markers are plain text to their tokenizers. In
# Mistral's and gpt-oss's the markers are special tokens ([TOOL_CALLS],
# <|channel|>, ...), which the engine writes into a forced call's grammar as
# the tokens themselves (TestSpecialMarkers pins which families these are).
FORCEABLE = ("llama3_tools", "qwen3_coder")
SPECIAL_MARKERS = {"mistral_tools": "[TOOL_CALLS]", "gpt_oss_harmony": "<|channel|>"}
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],  # type: ignore[index]
    "get_time": CLOCK["function"]["parameters"],  # type: ignore[index]
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPTS = (
    "Hello! How can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Count the objects in the image and list their colours.",
    "Is this a photo of a dog, a cat or a bird?",
)


@pytest.fixture(scope="module", params=TINY_TOOL_LM_TYPES)
def tiny_model_path(request: pytest.FixtureRequest) -> Path:
    """Each family in turn, for the ``serve`` and ``loaded`` fixtures."""
    return tiny_lm_path(request.param)


def template_of(path: Path) -> str:
    config = json.loads((path / "tokenizer_config.json").read_text())
    template: str = config["chat_template"]
    return template


class TestDetection:
    @pytest.mark.parametrize("family", TINY_TOOL_LM_TYPES)
    def test_each_family_is_detected_as_its_format(self, family: str) -> None:
        formats = model_formats(template_of(tiny_lm_path(family)))
        assert formats.names() == FORMATS[family]

    def test_the_listed_families_are_those_known(self) -> None:
        assert set(TINY_TOOL_LM_TYPES) == set(FORMATS)


class TestSpecialMarkers:
    @pytest.mark.parametrize("family", TINY_TOOL_LM_TYPES)
    def test_which_families_call_with_special_tokens(self, family: str) -> None:
        config = json.loads(
            (tiny_lm_path(family) / "tokenizer_config.json").read_text()
        )
        specials = {t["content"] for t in config["added_tokens_decoder"].values()}
        marker = SPECIAL_MARKERS.get(family)
        assert (marker in specials) if marker else family in FORCEABLE
        assert set(FORCEABLE) | set(SPECIAL_MARKERS) == set(TINY_TOOL_LM_TYPES)


@pytest.mark.slow
class TestBatching:
    async def test_rows_joining_and_leaving_match_each_solo_run(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        lengths = (4, 14, 10, 12)
        reqs = [
            batching_request(i, n, prompts=PROMPTS, sizes=(None,), top_logprobs=3)
            for i, n in enumerate(lengths)
        ]
        alone = [await solo(thread, loaded, req) for req in reqs]
        batch = BatchEngine(loaded, thread)
        assert not batch._state.exclusive
        gate = BatchGate(max_num_seqs=4, max_pending=4)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        async with deadline() as group:
            for run in runs[:3]:
                group.start_soon(run.run)
                await run.two_tokens.wait()
            await runs[0].done.wait()
            group.start_soon(runs[3].run)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        assert batch.statistics().peak_active >= 3

    async def test_prompts_arriving_together_match_each_solo_run(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        reqs = [
            batching_request(i, 5 + i, prompts=PROMPTS, sizes=(None,), top_logprobs=2)
            for i in range(4)
        ]
        alone = [await solo(thread, loaded, req) for req in reqs]
        batch = BatchEngine(loaded, thread)
        runs = await all_at_once(thread, batch, reqs)
        for run, expected in zip(runs, alone, strict=True):
            assert max_logprob_difference(run.events, expected) <= TOL
        assert batch.statistics().prefills == 4


@pytest.fixture
async def served(serve: Serve) -> AsyncIterator[Served]:
    async with serve() as app:
        yield app


async def whole_and_streamed(served: Served, **fields: Any) -> list[dict[str, Any]]:
    """One request's answer whole and streamed (joined from its deltas),
    each as content, reasoning, calls and finish."""
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, **fields}
    response = await served.chat(body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    whole = {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning_content") or "",
        "calls": [
            (call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls") or []
        ],
        "finish": choice["finish_reason"],
    }
    streamed = await served.chat({**body, "stream": True})
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]", events[-3:]
    joined = join_chat_chunks(
        ChatCompletionChunk.model_validate(e) for e in events[:-1]
    )
    stream = {
        "content": joined.content,
        "reasoning": joined.reasoning,
        "calls": joined.calls,
        "finish": joined.finish,
    }
    # Every answer of these tests: no format's markup in its content.
    for answer in (whole, stream):
        no_markup(answer)
    return [whole, stream]


def no_markup(answer: dict[str, Any]) -> None:
    """No format's markup in the answer's content or reasoning."""
    assert_no_markup(answer["content"], answer["reasoning"], context=answer)


class TestThroughTheOpenAIDoor:
    async def test_the_served_model_shows_its_familys_formats(
        self, served: Served, tiny_model_path: Path
    ) -> None:
        card = (await served.client.get(f"/v1/models/{MODEL}")).json()
        assert card["formats"] == FORMATS[tiny_model_path.name.removeprefix("tiny-lm-")]

    @pytest.mark.slow
    async def test_a_free_answer_with_tools_offered_streams_as_whole(
        self, served: Served
    ) -> None:
        answers = await whole_and_streamed(
            served, max_tokens=16, temperature=0, tools=[WEATHER, CLOCK]
        )
        for answer in answers:
            no_markup(answer)
            assert answer["finish"] == "length", answer
        assert answers[0] == answers[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tiny_model_path", [*FORCEABLE, *SPECIAL_MARKERS], indirect=True
)
class TestNamedCalls:
    async def test_a_named_call_parses_back_to_valid_arguments(
        self, served: Served
    ) -> None:
        answers = await whole_and_streamed(
            served,
            max_tokens=200,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        for answer in answers:
            assert answer["finish"] == "tool_calls", answer
            assert (answer["content"], answer["reasoning"]) == ("", ""), answer
            no_markup(answer)
            [(name, arguments)] = answer["calls"]
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert answers[0] == answers[1]


@pytest.mark.slow
@pytest.mark.parametrize("tiny_model_path", FORCEABLE, indirect=True)
class TestForcedCalls:
    async def test_a_required_call_parses_back_to_valid_arguments(
        self, served: Served
    ) -> None:
        answers = await whole_and_streamed(
            served,
            max_tokens=200,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
        )
        for answer in answers:
            assert answer["finish"] == "tool_calls", answer
            no_markup(answer)
            assert answer["calls"], answer
            for name, arguments in answer["calls"]:
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert answers[0] == answers[1]

    @pytest.mark.parametrize("max_tokens", [3, 12])
    async def test_a_cut_forced_call_leaves_no_markup(
        self, served: Served, max_tokens: int
    ) -> None:
        answers = await whole_and_streamed(
            served,
            max_tokens=max_tokens,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
        )
        for answer in answers:
            assert answer["finish"] == "length", answer
            no_markup(answer)
        assert answers[0] == answers[1]


@pytest.mark.slow
@pytest.mark.parametrize("tiny_model_path", list(SPECIAL_MARKERS), indirect=True)
class TestForcedCallsWithSpecialMarkers:
    async def test_one_required_call_parses_back_to_valid_arguments(
        self, served: Served
    ) -> None:
        # Parallel calls (one to MAX_FORCED_CALLS) on every family:
        # test_format_doors.py, at every door.
        answers = await whole_and_streamed(
            served,
            max_tokens=200,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        for answer in answers:
            assert answer["finish"] == "tool_calls", answer
            [(name, arguments)] = answer["calls"]
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert answers[0] == answers[1]


@pytest.mark.slow
class TestRoundTrip:
    async def test_a_forced_call_sent_back_renders_as_the_model_wrote_it(
        self, served: Served, tiny_model_path: Path
    ) -> None:
        # The call in the model's own syntax (its tokens' text), parsed,
        # then sent back as the assistant's tool_calls with its result: the
        # family's template renders the turn as the text the model wrote.
        tools = [WEATHER, CLOCK]
        response = await served.chat(
            {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": 200,
                "temperature": 0,
                "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                "logprobs": True,
            }
        )
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        written = "".join(entry["token"] for entry in choice["logprobs"]["content"])
        [call] = choice["message"]["tool_calls"]
        history = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "12:00"},
        ]
        request = ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": history}
        )
        turns = chat_messages(request.messages)
        loaded = served.model
        asked = await served.thread.run(build_prompt, loaded, turns[:1], tools)
        sent_back = await served.thread.run(build_prompt, loaded, turns, tools)
        if tiny_model_path.name.endswith("mistral_tools"):
            # Mistral v3's template writes each call's id (the server's),
            # which the model's call does not hold.
            sent_back = sent_back.replace(f', "id": "{call["id"]}"', "")
        assert sent_back.startswith(asked + written), (written, sent_back)
