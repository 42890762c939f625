"""Prompt log-probabilities (vLLM's ``prompt_logprobs``; completions' ``echo``
with ``logprobs``), computed in the prefill: each equals an in-process
forward pass of the same model within 1e-4, alone, batched with other
prompts, prefilled in chunks, or with the prompt cache on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.events import FinalEvent, PromptLogprob

from .conftest import MODEL
from .kit import (
    TOL,
    Event,
    Request,
    Serve,
    generation,
    interleaved,
    max_logprob_difference,
    request,
)

EXACT = 1e-4
TEXTS = (
    "The quick brown fox jumps over the lazy dog again and again",
    "Green trees, white clouds",
    "Hello! How can I help you today? Tell me.",
)


def forward_pass(loaded: LoadedModel, ids: Sequence[int]) -> mx.array:
    """The model's log-probabilities at every position of ``ids`` (T, V),
    in process, in one pass (on the MLX thread)."""
    logits = loaded.model.language_model(mx.array([list(ids)])).logits[0]
    logits = logits.astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def forward(thread: MLXThread, loaded: LoadedModel, ids: Sequence[int]) -> mx.array:
    return thread.run_sync(forward_pass, loaded, ids)


def encode(thread: MLXThread, loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(loaded.tokenizer.encode(text))  # the tokenizer alone: any thread


def scored(ids: tuple[int, ...], max_tokens: int = 3, top: int = 2) -> Request:
    return generation(
        (), prompt=ids, max_tokens=max_tokens, prompt_logprobs=top, temperature=0.0
    ), []


def prompt_of(events: list[Event]) -> tuple[PromptLogprob, ...]:
    final = events[-1]
    assert isinstance(final, FinalEvent)
    return final.prompt_logprobs


def entries(scores: Any) -> list[PromptLogprob]:
    """A row's scores as the entries its final event carries."""
    first, *rest = scores.tokens
    out = [PromptLogprob(first, "", [], None, None, ())]
    for token, logprob, rank, top in zip(
        rest, scores.logprobs, scores.ranks, scores.top, strict=True
    ):
        alternatives = tuple((i, "", value) for i, value in top)
        out.append(PromptLogprob(token, "", [], logprob, rank, alternatives))
    return out


def assert_exact(
    thread: MLXThread, loaded: LoadedModel, ids: Sequence[int], got: Any
) -> None:
    """``got`` (a prompt's entries) against the in-process pass: the chosen
    tokens' log-probabilities, their ranks, and the top alternatives."""
    reference = forward(thread, loaded, ids)
    assert [entry.token_id for entry in got] == list(ids)
    assert got[0].logprob is None
    for position, entry in enumerate(got[1:]):
        row = reference[position]
        expected = row[ids[position + 1]].item()
        assert entry.logprob == pytest.approx(expected, abs=EXACT)
        assert entry.rank == int(mx.sum(row > expected).item()) + 1
        best = mx.argsort(-row)[: len(entry.top)].tolist()
        assert [token for token, _, _ in entry.top] == best
        for token, _, value in entry.top:
            assert value == pytest.approx(row[token].item(), abs=EXACT)


class TestEngine:
    def test_alone_they_equal_a_forward_pass(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        ids = encode(thread, loaded, TEXTS[0])
        engine = thread.run_sync(BatchEngine, loaded, thread)
        (events,) = interleaved(thread, engine, [scored(ids)])
        assert_exact(thread, loaded, ids, prompt_of(events))

    def test_max_tokens_zero_gives_the_prompt_alone(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        ids = encode(thread, loaded, TEXTS[1])
        engine = thread.run_sync(BatchEngine, loaded, thread)
        (events,) = interleaved(thread, engine, [scored(ids, max_tokens=0)])
        assert len(events) == 1
        final = events[0]
        assert isinstance(final, FinalEvent)
        assert (final.completion_tokens, final.finish_reason) == (0, "length")
        assert len(final.prompt_logprobs) == len(ids)

    @pytest.mark.slow
    def test_batched_with_other_prompts_they_are_the_same(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        prompts = [encode(thread, loaded, text) for text in TEXTS]
        reqs = [scored(ids, top=3) for ids in prompts]
        reqs.insert(1, request(2, 6, top_logprobs=2))

        def run() -> tuple[list[Any], int]:
            state = BatchEngine(loaded, thread)._state
            rows = [state.admit(*req) for req in reqs]  # one prefill for all
            while not all(row.done for row in rows):
                state.step()
            return rows, state.statistics().prefill_passes

        rows, passes = thread.run_sync(run)
        assert passes == 1
        assert rows[1].scores is None
        for ids, row in zip(prompts, [rows[0], *rows[2:]], strict=True):
            assert_exact(thread, loaded, ids, entries(row.scores))

    @pytest.mark.slow
    def test_prefilled_in_chunks_they_are_the_same(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        ids = encode(thread, loaded, TEXTS[0])

        def chunked() -> BatchEngine:
            return BatchEngine(loaded, thread, prefill_step_size=5)

        engine = thread.run_sync(chunked)
        (events,) = interleaved(thread, engine, [scored(ids)])
        assert engine.statistics().prefill_passes > 3
        assert_exact(thread, loaded, ids, prompt_of(events))

    @pytest.mark.slow
    def test_a_cached_prefix_still_yields_its_logprobs(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        ids = encode(thread, loaded, TEXTS[0])

        def cached() -> BatchEngine:
            return BatchEngine(loaded, thread, prompt_cache_bytes=1 << 24)

        engine = thread.run_sync(cached)
        plain = generation((), prompt=ids, max_tokens=4, temperature=0.0)
        interleaved(thread, engine, [(plain, [])])
        interleaved(thread, engine, [(plain, [])])
        assert engine.counters().prompt_cache_hits >= 1  # the cache holds it
        (events,) = interleaved(thread, engine, [scored(ids)])
        assert_exact(thread, loaded, ids, prompt_of(events))

    def test_the_answer_is_the_same_with_them(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        ids = encode(thread, loaded, TEXTS[2])
        engine = thread.run_sync(BatchEngine, loaded, thread)
        fields: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0}
        without = generation((), prompt=ids, logprobs=True, **fields)
        with_them = generation(
            (), prompt=ids, logprobs=True, prompt_logprobs=1, **fields
        )
        ours, theirs = interleaved(thread, engine, [(with_them, []), (without, [])])
        assert max_logprob_difference(ours, theirs) <= TOL
        assert prompt_of(ours)
        assert not prompt_of(theirs)


def complete_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, **fields}


@pytest.mark.anyio
class TestCompletions:
    async def test_lm_evals_loglikelihood_request(
        self, serve: Serve, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        # lm-eval 0.4.13's local-completions request, as it sends it.
        ids = list(encode(thread, loaded, TEXTS[0]))
        body = complete_body(
            prompt=[ids], echo=True, logprobs=1, max_tokens=1, seed=1234
        )
        async with serve() as served:
            response = await served.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt, then 1
        assert logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None
        reference = await thread.run(forward_pass, loaded, ids)
        for position, value in enumerate(logprobs["token_logprobs"][1 : len(ids)]):
            expected = reference[position, ids[position + 1]].item()
            assert value == pytest.approx(expected, abs=EXACT)
        # is_greedy, as lm-eval reads it: the top entry per position.
        for position, top in enumerate(logprobs["top_logprobs"][1 : len(ids)]):
            (text,) = top
            best = int(mx.argmax(reference[position]).item())
            assert text == loaded.token_text(best)[0]
        assert choice["text"].startswith(await_text(loaded, ids))
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets)
        assert offsets[0] == 0

    async def test_max_tokens_zero_with_echo_is_the_prompt(self, serve: Serve) -> None:
        body = complete_body(prompt=TEXTS[1], echo=True, logprobs=0, max_tokens=0)
        async with serve() as served:
            response = await served.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        reply = response.json()
        assert reply["choices"][0]["text"] == TEXTS[1]
        assert reply["usage"]["completion_tokens"] == 0
        assert reply["choices"][0]["logprobs"]["top_logprobs"][1] == {}

    async def test_prompt_logprobs_in_vllms_shape_on_both_doors(
        self, serve: Serve, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        ids = list(encode(thread, loaded, TEXTS[2]))
        reference = await thread.run(forward_pass, loaded, ids)
        async with serve() as served:
            response = await served.client.post(
                "/v1/completions",
                json=complete_body(prompt=ids, max_tokens=2, prompt_logprobs=2),
            )
            assert response.status_code == 200, response.text
            entries = response.json()["choices"][0]["prompt_logprobs"]
            chat = await served.chat(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": TEXTS[2]}],
                    "max_tokens": 2,
                    "prompt_logprobs": 0,
                }
            )
            assert chat.status_code == 200, chat.text
            chat_entries = chat.json()["prompt_logprobs"]
        assert entries[0] is None
        assert len(entries) == len(ids)
        for position, entry in enumerate(entries[1:]):
            token = ids[position + 1]
            mine = entry[str(token)]
            expected = reference[position, token].item()
            assert mine["logprob"] == pytest.approx(expected, abs=EXACT)
            assert mine["decoded_token"] == loaded.token_text(token)[0]
            assert 2 <= len(entry) <= 3  # the token and its top 2
            ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token))
            assert ranks == [1, 2]
        assert chat_entries[0] is None
        assert all(len(entry) == 1 for entry in chat_entries[1:])

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"max_tokens": 0}, "max_tokens"),
            ({"prompt_logprobs": 21}, "prompt_logprobs"),
            ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
        ],
    )
    async def test_what_cannot_be_is_a_400(
        self, serve: Serve, fields: dict[str, Any], param: str
    ) -> None:
        async with serve() as served:
            response = await served.client.post(
                "/v1/completions", json=complete_body(prompt="Hi", **fields)
            )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def await_text(loaded: LoadedModel, ids: Sequence[int]) -> str:
    return str(loaded.tokenizer.decode(list(ids)))
