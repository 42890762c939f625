"""A prompt's log-probabilities (vLLM's ``prompt_logprobs``), read from the
logits of its prefill passes. MLX thread only.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import mlx.core as mx

__all__ = ["PromptScores", "Scoring"]


class PromptScores(NamedTuple):
    """The log-probabilities of a prompt's tokens from the second on, each under
    the model's raw distribution after the tokens before it.

    Attributes:
        tokens: The prompt's tokens, the first included.
        ranks: Each one's rank in its distribution (1: the most likely).
        top: Each position's most likely tokens, likeliest first.
    """

    tokens: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


class Scoring:
    """A prompt's scores as its prefill passes compute them, lazily: each
    pass's logits (T, V) for the prompt's tokens after its positions."""

    def __init__(self, ids: mx.array, top: int) -> None:
        self.ids = ids.reshape(-1)
        self.top = top
        self.parts: list[tuple[mx.array, ...]] = []

    def add(self, logits: mx.array, start: int) -> None:
        """The logits of positions ``start`` onwards (one pass's)."""
        targets = self.ids[start + 1 : start + 1 + logits.shape[0]]
        logits = logits[: targets.shape[0]].astype(mx.float32)
        # Media placeholders past the vocabulary (some families') are read
        # as its last token rather than outside the array.
        targets = mx.minimum(targets, logits.shape[-1] - 1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        ranks = mx.sum(logprobs > chosen[:, None], axis=-1) + 1
        part: tuple[mx.array, ...] = (targets, chosen, ranks)
        if self.top:
            keep = min(self.top, logprobs.shape[-1])
            ids = mx.argpartition(-logprobs, kth=keep - 1, axis=-1)[:, :keep]
            part += (ids, mx.take_along_axis(logprobs, ids, axis=-1))
        mx.async_eval(part)  # type: ignore[no-untyped-call]
        self.parts.append(part)

    def scores(self) -> PromptScores:
        out = PromptScores([cast("int", self.ids[0].item())], [], [], [])
        for part in self.parts:
            out.tokens.extend(cast("list[int]", part[0].tolist()))
            out.logprobs.extend(cast("list[float]", part[1].tolist()))
            out.ranks.extend(cast("list[int]", part[2].tolist()))
            if len(part) == 3:
                out.top.extend([] for _ in range(part[0].shape[0]))
                continue
            ids = cast("list[list[int]]", part[3].tolist())
            values = cast("list[list[float]]", part[4].tolist())
            for row_ids, row_values in zip(ids, values, strict=True):
                pairs = sorted(
                    zip(row_ids, row_values, strict=True), key=lambda p: -p[1]
                )
                out.top.append(pairs)
        return out
