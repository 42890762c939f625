"""vLLM's ``stop_reason`` on both OpenAI doors, through the official SDK:
the stop token's id or the stop string that ended a choice, null for an end
of turn and for ``length``; whole, and on the stream chunk that carries
``finish_reason`` (and on no other).

The SDK keeps a field it does not know in ``model_extra``: that is where a
client reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai
import pytest

from mlx_pinned.server.engine.rows import end_of_turn_ids

from .conftest import MODEL
from .kit import Serve, Served

# asyncio only: the SDK's async stream leaves its httpx generators to the
# garbage collector, which trio reports as a ResourceWarning (an error).
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

MESSAGES = [{"role": "user", "content": "Hello there"}]


@dataclass
class Ended:
    """How one choice ended, as the client read it."""

    finish_reason: str | None
    stop_reason: Any
    text: str
    ids: list[int]


def _ids(tokens: list[str]) -> list[int]:
    """Token ids from ``token_id:N`` (``return_tokens_as_token_ids``)."""
    return [int(token.removeprefix("token_id:")) for token in tokens]


async def whole(client: openai.AsyncOpenAI, door: str, **fields: Any) -> Ended:
    if door == "chat":
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, **fields},
        )
        choice = chat.choices[0]
        assert choice.logprobs is not None
        assert choice.logprobs.content is not None
        assert choice.model_extra is not None
        return Ended(
            choice.finish_reason,
            choice.model_extra["stop_reason"],
            choice.message.content or "",
            _ids([entry.token for entry in choice.logprobs.content]),
        )
    completion = await client.completions.create(
        model=MODEL,
        prompt="Hello there",
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, **fields},
    )
    legacy = completion.choices[0]
    assert legacy.logprobs is not None
    assert legacy.logprobs.tokens is not None
    assert legacy.model_extra is not None
    return Ended(
        legacy.finish_reason,
        legacy.model_extra["stop_reason"],
        legacy.text,
        _ids(legacy.logprobs.tokens),
    )


async def streamed(client: openai.AsyncOpenAI, door: str, **fields: Any) -> Ended:
    """The streamed answer; asserts ``stop_reason`` is on the chunk with
    ``finish_reason`` and on no other."""
    extras: list[tuple[str | None, dict[str, Any]]] = []
    text: list[str] = []
    if door == "chat":
        chunks = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=fields,
        )
        async with chunks:
            async for chunk in chunks:
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    extra = dict(choice.model_extra or {})
                    extras.append((choice.finish_reason, extra))
    else:
        legacy = await client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=fields,
        )
        async with legacy:
            async for piece in legacy:
                for each in piece.choices:
                    text.append(each.text)
                    extras.append((each.finish_reason, dict(each.model_extra or {})))
    (last,) = [extra for reason, extra in extras if reason is not None]
    assert extras[-1][1] is last, "the finish chunk is the last with a choice"
    assert all("stop_reason" not in extra for extra in (e for _, e in extras[:-1]))
    assert "stop_reason" in last
    return Ended(extras[-1][0], last["stop_reason"], "".join(text), [])


async def both(served: Served, door: str, **fields: Any) -> Ended:
    """The whole answer, after checking the streamed one ends the same."""
    client = served.sdk()
    one = await whole(client, door, **fields)
    other = await streamed(client, door, **fields)
    assert (other.finish_reason, other.stop_reason, other.text) == (
        one.finish_reason,
        one.stop_reason,
        one.text,
    )
    return one


DOORS = ["chat", "completions"]


@pytest.mark.parametrize("door", DOORS)
async def test_a_stop_token_id_is_the_stop_reason(serve: Serve, door: str) -> None:
    async with serve() as served:
        plain = await whole(served.sdk(), door)
        stop = plain.ids[3]
        got = await both(served, door, stop_token_ids=[stop])
    assert got.ids == plain.ids[: plain.ids.index(stop)]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert isinstance(got.stop_reason, int)


@pytest.mark.parametrize("door", DOORS)
async def test_a_stop_string_is_the_stop_reason(serve: Serve, door: str) -> None:
    async with serve() as served:
        plain = await whole(served.sdk(), door)
        stop = plain.text[4:6]
        cut = plain.text[: plain.text.index(stop)]
        got = await both(served, door, stop=[stop, "never in it"])
        kept = await both(served, door, stop=[stop], include_stop_str_in_output=True)
    assert (got.text, got.finish_reason, got.stop_reason) == (cut, "stop", stop)
    assert (kept.text, kept.stop_reason) == (cut + stop, stop)


@pytest.mark.parametrize("door", DOORS)
async def test_an_end_of_turn_and_length_have_none(serve: Serve, door: str) -> None:
    async with serve() as served:
        eos = end_of_turn_ids(served.model)[0]
        forced = {"logit_bias": {str(eos): 100}}
        ended = await both(served, door, **forced, min_tokens=2)
        # An end of turn named as a stop token is still an end of turn
        # (vLLM's order), unless the end of turn is ignored.
        named = await both(served, door, **forced, stop_token_ids=[eos])
        ignored = await both(
            served, door, **forced, stop_token_ids=[eos], ignore_eos=True
        )
        cut = await both(served, door, **forced, ignore_eos=True)
    assert (ended.finish_reason, ended.stop_reason, len(ended.ids)) == ("stop", None, 2)
    assert (named.finish_reason, named.stop_reason) == ("stop", None)
    assert (ignored.finish_reason, ignored.stop_reason) == ("stop", eos)
    assert (cut.finish_reason, cut.stop_reason, len(cut.ids)) == ("length", None, 12)
