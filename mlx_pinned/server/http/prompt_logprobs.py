"""A prompt's log-probabilities as the doors write them: vLLM's
``prompt_logprobs`` shape, shared by chat and legacy completions.

Event loop (pure CPU). The engine computes them in the prompt's prefill
(:class:`~..events.PromptLogprob`, one per prompt token); here each becomes
vLLM's entry: ``null`` for the first token, else ``{token id: {"logprob",
"rank", "decoded_token"}}`` holding the prompt's token and the most likely
ones there.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from ..events import PromptLogprob

__all__ = ["PromptTokenLogprob", "VLLMPromptLogprobs", "vllm_prompt_logprobs"]


class PromptTokenLogprob(BaseModel):
    """One token of one prompt position, as vLLM writes it."""

    model_config = ConfigDict(extra="forbid")

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token, null for the first.
VLLMPromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


def vllm_prompt_logprobs(
    entries: Sequence[PromptLogprob], top: int
) -> VLLMPromptLogprobs:
    """``entries`` in vLLM's shape, with ``top`` alternatives each."""
    out: VLLMPromptLogprobs = []
    for entry in entries:
        if entry.logprob is None or entry.rank is None:
            out.append(None)
            continue
        tokens: dict[str, PromptTokenLogprob] = {}
        for rank, (token_id, text, value) in enumerate(entry.top[:top], start=1):
            tokens[str(token_id)] = PromptTokenLogprob(
                logprob=value, rank=rank, decoded_token=text
            )
        tokens.setdefault(
            str(entry.token_id),
            PromptTokenLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=entry.token
            ),
        )
        out.append(tokens)
    return out
