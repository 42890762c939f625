"""vLLM's extension fields, honoured as vLLM documents them: the stopping
ones (``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``), the vocabulary ones (``allowed_token_ids``)
and the text ones (``skip_special_tokens``).

Each is checked where it acts (the engine's rows, batched and alone, and
with speculative decoding), and through the HTTP doors; each test would fail
if the field were ignored.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, DraftSettings, LoadedModel
from mlx_pinned.server.engine.rows import end_of_turn_ids
from mlx_pinned.server.engine.special_tokens import special_tokens
from mlx_pinned.server.events import FinalEvent
from mlx_pinned.server.http.served_models import BatchGate

from .conftest import MODEL, vision_body
from .kit import (
    TOL,
    Event,
    Request,
    Serve,
    interleaved,
    max_logprob_difference,
    request,
    tokens,
)

# A prompt that repeats itself: prompt lookup drafts on it.
ECHO = ("one two three one two three one two three one two three",)


def eos(loaded: LoadedModel) -> int:
    return end_of_turn_ids(loaded)[0]


def forced_eos(loaded: LoadedModel) -> tuple[tuple[int, float], ...]:
    """A logit bias that makes the end of turn the greedy pick."""
    return ((eos(loaded), 100.0),)


def final(events: list[Event]) -> FinalEvent:
    last = events[-1]
    assert isinstance(last, FinalEvent)
    return last


def run(thread: MLXThread, loaded: LoadedModel, *reqs: Request) -> list[list[Event]]:
    engine = thread.run_sync(BatchEngine, loaded, thread)
    return interleaved(thread, engine, reqs)


def token_ids(loaded: LoadedModel, events: list[Event]) -> list[int]:
    """The generated tokens' ids (each event's logprobs name its token)."""
    vocab = {loaded.token_text(i)[0]: i for i in range(loaded.vocab_size)}
    out = []
    for event in tokens(events):
        assert event.logprobs is not None
        out.append(vocab[event.logprobs.token])
    return out


class TestStopping:
    def test_a_forced_end_of_turn_ends_at_once(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # The baseline the next tests move: without them, no token at all.
        (events,) = run(thread, loaded, request(0, 8, logit_bias=forced_eos(loaded)))
        assert (final(events).completion_tokens, final(events).finish_reason) == (
            0,
            "stop",
        )

    def test_min_tokens_keeps_the_end_of_turn_off_until_then(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        req = request(0, 12, logit_bias=forced_eos(loaded), min_tokens=5)
        (events,) = run(thread, loaded, req)
        assert final(events).completion_tokens == 5
        assert final(events).finish_reason == "stop"
        assert eos(loaded) not in token_ids(loaded, events)

    def test_ignore_eos_runs_exactly_to_max_tokens(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        req = request(0, 9, logit_bias=forced_eos(loaded), ignore_eos=True)
        (events,) = run(thread, loaded, req)
        assert final(events).completion_tokens == 9
        assert final(events).finish_reason == "length"
        assert set(token_ids(loaded, events)) == {eos(loaded)}

    def test_a_stop_token_id_ends_the_answer_on_that_token(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        (plain,) = run(thread, loaded, request(1, 16))
        ids = token_ids(loaded, plain)
        at = 3
        stop = ids[at]
        first = ids.index(stop)
        (events,) = run(thread, loaded, request(1, 16, stop_token_ids=(stop,)))
        # The tokens before it, unchanged; the stop token ends the turn.
        assert token_ids(loaded, events) == ids[:first]
        assert final(events).finish_reason == "stop"

    def test_min_tokens_holds_a_stop_token_off_too(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        (plain,) = run(thread, loaded, request(1, 16))
        ids = token_ids(loaded, plain)
        stop = ids[0]
        req = request(1, 16, stop_token_ids=(stop,), min_tokens=4)
        (events,) = run(thread, loaded, req)
        got = token_ids(loaded, events)
        assert len(got) >= 4
        assert stop not in got[:4]


class TestVocabulary:
    def test_allowed_token_ids_bound_every_token(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        allowed = (40, 41, 42, 77)
        req = request(2, 10, allowed_token_ids=allowed, top_logprobs=3)
        (events,) = run(thread, loaded, req)
        got = token_ids(loaded, events)
        assert len(got) == 10
        assert set(got) <= set(allowed)
        for event in tokens(events):
            assert event.logprobs is not None
            # Log-probabilities of the allowed tokens only: they sum to 1.
            assert len(event.logprobs.top) == 3


class TestExactUnderBatching:
    @pytest.mark.slow
    def test_rows_that_bar_tokens_batched_equal_each_alone(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        bias = forced_eos(loaded)
        reqs = [
            request(0, 10, logit_bias=bias, min_tokens=6, top_logprobs=2),
            request(1, 12, top_logprobs=2),
            request(2, 8, allowed_token_ids=(40, 41, 42, 77), top_logprobs=2),
            request(3, 9, ignore_eos=True, top_logprobs=2),
        ]
        alone = [run(thread, loaded, req)[0] for req in reqs]
        engine = thread.run_sync(BatchEngine, loaded, thread)
        batched = interleaved(thread, engine, reqs, (0, 2, 3, 5))
        for mine, solo in zip(batched, alone, strict=True):
            assert max_logprob_difference(mine, solo) <= TOL
        assert engine.statistics().peak_active >= 3


class TestSpeculative:
    @pytest.mark.slow
    def test_drafting_rows_keep_min_tokens_and_stop_tokens(
        self, thread: MLXThread, loaded_lm: LoadedModel
    ) -> None:
        def echo(index: int, max_tokens: int, **params: Any) -> Request:
            return request(index, max_tokens, prompts=ECHO, sizes=(None,), **params)

        (plain,) = run(thread, loaded_lm, echo(0, 24))
        ids = token_ids(loaded_lm, plain)
        reqs = [
            echo(0, 24, stop_token_ids=(ids[10],), min_tokens=8),
            echo(1, 24, allowed_token_ids=tuple(sorted(set(ids)))[:6]),
            echo(2, 20, min_tokens=20, stop_token_ids=(ids[2],)),
        ]
        off = [run(thread, loaded_lm, req)[0] for req in reqs]

        def drafting() -> BatchEngine:
            engine = BatchEngine(loaded_lm, thread)
            engine.speculate(DraftSettings(ngram=3, tokens=4))
            return engine

        on = thread.run_sync(drafting)
        for mine, solo in zip(interleaved(thread, on, reqs), off, strict=True):
            assert max_logprob_difference(mine, solo) <= TOL
            assert final(mine).stop_reason == final(solo).stop_reason
        assert on.statistics().accepted_tokens > 0
        assert final(off[0]).stop_reason == ids[10]  # vLLM's, the stop token
        assert len(tokens(off[2])) == 20  # min_tokens is max_tokens
        # A row that bars bad words drafts: each position barred as alone.
        kept = on.statistics().accepted_tokens
        banned = [echo(3, 16, bad_words=("two", "three one"))]
        (alone,) = [run(thread, loaded_lm, req)[0] for req in banned]
        (mine,) = interleaved(thread, on, banned)
        assert max_logprob_difference(mine, alone) <= TOL
        assert on.statistics().accepted_tokens > kept


async def chat(serve: Serve, **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    async with serve() as served:
        response = await served.chat({**body, **fields})
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


async def complete(serve: Serve, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 12}
    async with serve() as served:
        response = await served.client.post(
            "/v1/completions", json={**body, "temperature": 0, **fields}
        )
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


@pytest.mark.anyio
class TestDoors:
    async def test_ignore_eos_and_min_tokens_on_both_doors(
        self, serve: Serve, loaded: LoadedModel
    ) -> None:
        bias = {str(eos(loaded)): 100}
        reply = await chat(serve, logit_bias=bias, ignore_eos=True, max_tokens=7)
        assert reply["usage"]["completion_tokens"] == 7
        assert reply["choices"][0]["finish_reason"] == "length"
        reply = await complete(serve, logit_bias=bias, min_tokens=3)
        assert reply["usage"]["completion_tokens"] == 3
        assert reply["choices"][0]["finish_reason"] == "stop"

    async def test_a_stop_string_is_kept_with_include_stop_str_in_output(
        self, serve: Serve
    ) -> None:
        plain = (await complete(serve))["choices"][0]["text"]
        stop = plain[4:6]
        cut = plain[: plain.index(stop)]
        got = await complete(serve, stop=[stop])
        assert got["choices"][0]["text"] == cut
        got = await complete(serve, stop=[stop], include_stop_str_in_output=True)
        assert got["choices"][0]["text"] == cut + stop

    async def test_skip_special_tokens_leaves_them_out_of_the_text(
        self, serve: Serve, loaded: LoadedModel
    ) -> None:
        name, token = next(
            (n, t) for n, t in special_tokens(loaded).items() if "pad" in n
        )
        fields = {"allowed_token_ids": [token, 65], "logit_bias": {str(token): 5}}
        kept = await chat(serve, **fields, max_tokens=4)
        assert name in kept["choices"][0]["message"]["content"]
        left = await chat(serve, **fields, max_tokens=4, skip_special_tokens=True)
        content = left["choices"][0]["message"]["content"]
        assert name not in content
        assert content == kept["choices"][0]["message"]["content"].replace(name, "")

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"stop_token_ids": [10**6]}, "stop_token_ids"),
            ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
            ({"min_tokens": 13}, "min_tokens"),
            ({"min_tokens": -1}, "min_tokens"),
            ({"allowed_token_ids": []}, "allowed_token_ids"),
        ],
    )
    async def test_bad_values_are_a_400_naming_the_field(
        self, serve: Serve, fields: dict[str, Any], param: str
    ) -> None:
        async with serve() as served:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 12,
                **fields,
            }
            response = await served.chat(body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
            response = await served.client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 12, **fields},
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param


BOOLEAN = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.mark.anyio
class TestStructuredOutputs:
    @pytest.mark.parametrize(
        "fields",
        [
            {"guided_choice": ["yes", "no"]},
            {"structured_outputs": {"choice": ["yes", "no"]}},
        ],
    )
    async def test_a_choice_is_one_of_them(
        self, serve: Serve, fields: dict[str, Any]
    ) -> None:
        reply = await chat(serve, max_tokens=30, **fields)
        assert reply["choices"][0]["message"]["content"] in ("yes", "no")
        assert reply["choices"][0]["finish_reason"] == "stop"

    @pytest.mark.parametrize(
        "fields",
        [
            {"guided_json": BOOLEAN},
            {"structured_outputs": {"json": json.dumps(BOOLEAN)}},
        ],
    )
    async def test_a_json_schema_holds_on_both_doors(
        self, serve: Serve, fields: dict[str, Any]
    ) -> None:
        reply = await chat(serve, max_tokens=30, **fields)
        assert isinstance(
            json.loads(reply["choices"][0]["message"]["content"])["a"], bool
        )
        reply = await complete(serve, max_tokens=30, **fields)
        assert isinstance(json.loads(reply["choices"][0]["text"])["a"], bool)

    async def test_a_regex_is_matched_whole(self, serve: Serve) -> None:
        for fields in (
            {"guided_regex": "[ab]{3}-[0-9]"},
            {"structured_outputs": {"regex": "[ab]{3}-[0-9]"}},
        ):
            text = (await complete(serve, max_tokens=30, **fields))["choices"][0]
            assert re.fullmatch("[ab]{3}-[0-9]", text["text"]), text

    async def test_a_lark_grammar_is_followed(self, serve: Serve) -> None:
        grammar = 'start: "x" ("y" | "z") "!"'
        reply = await chat(serve, max_tokens=30, guided_grammar=grammar)
        assert reply["choices"][0]["message"]["content"] in ("xy!", "xz!")

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            (
                {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
                "guided_regex",
            ),
            (
                {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
                "guided_choice",
            ),
            ({"structured_outputs": {}}, "structured_outputs"),
            (
                {"structured_outputs": {"regex": "a", "choice": ["b"]}},
                "structured_outputs",
            ),
            ({"guided_grammar": "start: ::= x"}, "guided_grammar"),
            ({"guided_json": {"type": "nope"}}, "guided_json"),
            ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
        ],
    )
    async def test_bad_or_conflicting_constraints_are_a_400(
        self, serve: Serve, fields: dict[str, Any], param: str
    ) -> None:
        async with serve() as served:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                **fields,
            }
            response = await served.chat(body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith(param), response.text


PREFILL = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Sure, the"},
]


@pytest.mark.anyio
class TestAssistantPrefill:
    async def test_continue_final_message_continues_the_assistants_text(
        self, serve: Serve, loaded: LoadedModel
    ) -> None:
        from mlx_vlm.prompt_utils import apply_chat_template

        rendered = apply_chat_template(
            loaded.processor,
            loaded.config,
            PREFILL,
            add_generation_prompt=False,
            continue_final_message=True,
        )
        assert str(rendered).endswith("Sure, the")
        fields = {"logprobs": True, "messages": PREFILL}
        reply = await chat(
            serve, add_generation_prompt=False, continue_final_message=True, **fields
        )
        raw = await complete(
            serve, prompt=str(rendered), add_special_tokens=False, logprobs=1
        )
        assert reply["choices"][0]["message"]["content"] == raw["choices"][0]["text"]
        ours = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
        theirs = raw["choices"][0]["logprobs"]["token_logprobs"]
        assert ours == pytest.approx(theirs, abs=TOL)
        # Without it, the assistant's turn is closed and a new one opened.
        plain = await chat(serve, **fields)
        assert (
            plain["choices"][0]["message"]["content"]
            != reply["choices"][0]["message"]["content"]
        )

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"continue_final_message": True}, "continue_final_message"),
            (
                {
                    "continue_final_message": True,
                    "add_generation_prompt": False,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
                "continue_final_message",
            ),
            ({"add_special_tokens": True}, "add_special_tokens"),
        ],
    )
    async def test_a_prefill_that_cannot_be_is_a_400(
        self, serve: Serve, fields: dict[str, Any], param: str
    ) -> None:
        async with serve() as served:
            body = {"model": MODEL, "messages": PREFILL, **fields}
            response = await served.chat(body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


class TestBadWords:
    def test_a_bad_word_never_ends_in_the_answer(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        (plain,) = run(thread, loaded, request(1, 24))
        ids = token_ids(loaded, plain)
        # Two generated tokens in a row that a word's text tokenizes back to.
        encode = loaded.tokenizer.encode
        at, word = next(
            (i, text)
            for i in range(1, len(ids) - 1)
            if ids[i] != ids[i + 1]
            and encode(text := loaded.tokenizer.decode(ids[i : i + 2]).lstrip())
            == ids[i : i + 2]
        )
        (events,) = run(thread, loaded, request(1, 24, bad_words=(word,)))
        got = token_ids(loaded, events)
        assert got[: at + 1] == ids[: at + 1]  # the same up to the word's end
        assert got[at + 1] != ids[at + 1]
        pairs = list(itertools.pairwise(got))
        assert (ids[at], ids[at + 1]) not in pairs

    def test_a_one_token_word_is_never_generated(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        (plain,) = run(thread, loaded, request(2, 16))
        ids = token_ids(loaded, plain)
        # The most frequent token past the first whose text is itself.
        word = max(
            (
                text
                for token in set(ids[1:])
                if loaded.tokenizer.encode(text := loaded.tokenizer.decode([token]))
                == [token]
                and text.strip()
            ),
            key=lambda text: ids[1:].count(loaded.tokenizer.encode(text)[0]),
        )
        assert ids[1:].count(loaded.tokenizer.encode(word)[0]) >= 1
        (events,) = run(thread, loaded, request(2, 16, bad_words=(word,)))
        banned = set(loaded.tokenizer.encode(word))
        banned |= set(loaded.tokenizer.encode(" " + word.lstrip())[:1])
        assert not banned & set(token_ids(loaded, events))

    @pytest.mark.slow
    def test_bad_words_rows_batched_equal_each_alone(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        reqs = [
            request(0, 12, bad_words=("the", "a b"), top_logprobs=2),
            request(1, 12, top_logprobs=2),
            request(3, 10, bad_words=("he",), top_logprobs=2),
        ]
        alone = [run(thread, loaded, req)[0] for req in reqs]
        engine = thread.run_sync(BatchEngine, loaded, thread)
        batched = interleaved(thread, engine, reqs, (0, 1, 3))
        for mine, solo in zip(batched, alone, strict=True):
            assert max_logprob_difference(mine, solo) <= TOL

    @pytest.mark.anyio
    async def test_bad_words_are_taken_on_both_doors(self, serve: Serve) -> None:
        reply = await chat(serve, bad_words=["Hello"], max_tokens=3)
        assert reply["usage"]["completion_tokens"] == 3
        reply = await complete(serve, bad_words=["Hello"], max_tokens=3)
        assert reply["usage"]["completion_tokens"] == 3


@pytest.mark.anyio
class TestPriority:
    async def test_the_lowest_priority_waiting_goes_first_fifo_within(self) -> None:
        gate = BatchGate(max_num_seqs=1, max_pending=8)
        order: list[str] = []
        release = anyio.Event()

        async def holder() -> None:
            async with gate.turn():
                await release.wait()

        async def waiter(name: str, priority: int) -> None:
            async with gate.turn(priority):
                order.append(name)

        async with anyio.create_task_group() as group:
            group.start_soon(holder)
            await wait_for(lambda: gate.active == 1)
            for name, priority in [("b", 5), ("c", 1), ("d", 1), ("e", -2), ("f", 5)]:
                group.start_soon(waiter, name, priority)
                await wait_for(lambda waiting=gate.waiting: gate.waiting == waiting + 1)
            release.set()
        assert order == ["e", "c", "d", "b", "f"]

    @pytest.mark.parametrize("cancelled_while", ["waiting", "handed"])
    async def test_a_waiter_cancelled_gives_its_place_up(
        self, cancelled_while: str
    ) -> None:
        gate = BatchGate(max_num_seqs=1, max_pending=8)
        order: list[str] = []
        release = anyio.Event()
        scopes: dict[str, anyio.CancelScope] = {}

        async def holder() -> None:
            async with gate.turn():
                await release.wait()
                if cancelled_while == "handed":  # then handed the slot at once
                    scopes["x"].cancel()

        async def waiter(name: str, priority: int) -> None:
            with anyio.CancelScope() as scopes[name]:
                async with gate.turn(priority):
                    order.append(name)

        # A slot lost on the way would leave y waiting: a failure, not a hang.
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(holder)
                await wait_for(lambda: gate.active == 1)
                group.start_soon(waiter, "x", 0)
                await wait_for(lambda: gate.waiting == 1)
                group.start_soon(waiter, "y", 5)
                await wait_for(lambda: gate.waiting == 2)
                if cancelled_while == "waiting":
                    scopes["x"].cancel()
                    await wait_for(lambda: gate.waiting == 1)
                release.set()
        assert order == ["y"]
        assert (gate.active, gate.waiting) == (0, 0)

    async def test_priority_is_accepted_on_both_doors(self, serve: Serve) -> None:
        reply = await chat(serve, priority=-3, max_tokens=2)
        assert reply["usage"]["completion_tokens"] == 2
        reply = await complete(serve, priority=7, max_tokens=2)
        assert reply["usage"]["completion_tokens"] == 2


async def wait_for(condition: Any) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.lowlevel.checkpoint()


@pytest.mark.anyio
async def test_return_tokens_as_token_ids_names_every_token_by_its_id(
    serve: Serve, loaded: LoadedModel
) -> None:
    fields = {"logprobs": True, "top_logprobs": 2}
    plain = (await chat(serve, **fields))["choices"][0]["logprobs"]["content"]
    named = await chat(serve, return_tokens_as_token_ids=True, **fields)
    for mine, theirs in zip(
        named["choices"][0]["logprobs"]["content"], plain, strict=True
    ):
        token_id = int(mine["token"].removeprefix("token_id:"))
        assert loaded.token_text(token_id)[0] == theirs["token"]
        assert mine["bytes"] == theirs["bytes"]
        assert mine["logprob"] == theirs["logprob"]
        assert all(t["token"].startswith("token_id:") for t in mine["top_logprobs"])
    legacy = await complete(serve, logprobs=2, return_tokens_as_token_ids=True)
    tokens = legacy["choices"][0]["logprobs"]["tokens"]
    assert tokens
    assert all(t.startswith("token_id:") for t in tokens)


@pytest.mark.anyio
class TestTruncatePromptTokens:
    async def test_the_prompts_last_tokens_are_kept(self, serve: Serve) -> None:
        ids = list(range(40, 60))
        async with serve(max_prompt_tokens=8) as served:
            post = served.client.post
            cut = await post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": ids,
                    "max_tokens": 4,
                    "logprobs": 1,
                    "truncate_prompt_tokens": 6,
                },
            )
            short = await post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": ids[-6:],
                    "max_tokens": 4,
                    "logprobs": 1,
                },
            )
            whole = await post(
                "/v1/completions",
                json={"model": MODEL, "prompt": ids, "max_tokens": 4},
            )
        assert cut.status_code == short.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 6
        assert (
            cut.json()["choices"][0]["logprobs"]
            == short.json()["choices"][0]["logprobs"]
        )
        assert whole.status_code == 400  # over the prompt limit, uncut

    async def test_a_chat_is_cut_after_its_template(self, serve: Serve) -> None:
        messages = [{"role": "user", "content": "Hello there, how are you today?"}]
        async with serve() as served:
            tokens = await served.client.post(
                "/tokenize", json={"model": MODEL, "messages": messages}
            )
            ids = tokens.json()["tokens"]
            cut = await served.chat(
                {
                    "model": MODEL,
                    "messages": messages,
                    "max_tokens": 4,
                    "temperature": 0,
                    "logprobs": True,
                    "truncate_prompt_tokens": 5,
                }
            )
            raw = await served.client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": ids[-5:],
                    "max_tokens": 4,
                    "temperature": 0,
                    "logprobs": 0,
                },
            )
        assert cut.status_code == 200, cut.text
        assert len(ids) > 5
        assert cut.json()["usage"]["prompt_tokens"] == 5
        ours = [t["logprob"] for t in cut.json()["choices"][0]["logprobs"]["content"]]
        assert ours == pytest.approx(
            raw.json()["choices"][0]["logprobs"]["token_logprobs"], abs=TOL
        )

    @pytest.mark.parametrize("value", [0, -2])
    async def test_a_bad_value_is_a_400(self, serve: Serve, value: int) -> None:
        async with serve() as served:
            body = {
                "model": MODEL,
                "messages": PREFILL[:1],
                "truncate_prompt_tokens": value,
            }
            response = await served.chat(body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "truncate_prompt_tokens"

    async def test_a_prompt_with_an_image_is_not_cut(self, serve: Serve) -> None:
        async with serve() as served:
            body = vision_body(4, truncate_prompt_tokens=3)
            response = await served.chat(body)
            kept = await served.chat(vision_body(4, truncate_prompt_tokens=-1))
        assert response.status_code == 400, response.text
        assert "truncate_prompt_tokens" in response.json()["error"]["message"]
        assert kept.status_code == 200, kept.text


@pytest.mark.anyio
async def test_fields_that_leave_no_token_still_answer(
    serve: Serve, loaded: LoadedModel
) -> None:
    # allowed_token_ids all held off by min_tokens, and all outside a grammar:
    # the bar is lifted rather than sampling from nothing.
    reply = await chat(serve, allowed_token_ids=[eos(loaded)], min_tokens=3)
    assert reply["choices"][0]["finish_reason"] == "stop"
    reply = await chat(
        serve, allowed_token_ids=[65, 66], guided_choice=["zzz"], max_tokens=4
    )
    assert reply["choices"][0]["message"]["content"] == "zzz"
