"""What a row does to its logits before sampling: penalties, grammars, bad
words and logit bias, per row on a step's (B, V) logits. A row that asks
for none of them keeps its logits bit for bit. MLX thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from ..grammars import GRAMMARS
from .sampling import free_draw
from .special_tokens import special_literals, special_tokens

if TYPE_CHECKING:
    from ..events import Grammar, SamplingParams
    from .model import LoadedModel

__all__ = [
    "Banning",
    "Constrained",
    "GrammarMatcher",
    "Penalized",
    "advance",
    "ban_words",
    "banned_sequences",
    "bias_rows",
    "constrain",
    "fill_masks",
    "mask",
    "new_matcher",
    "penalize",
    "prompt_seen",
    "speculates",
]


# Fresh matchers a model keeps, one per grammar, to copy (see new_matcher).
MATCHERS_KEPT = 64


class Biased(Protocol):
    sampling: SamplingParams  # its logit_bias: (token id, bias) pairs
    bias_row: mx.array | None  # (V,) made on first use


class Penalized(Protocol):
    sampling: SamplingParams  # its penalties
    counts: mx.array | None  # (V,) times each token was generated so far
    seen: mx.array | None  # (V,) tokens of the prompt


def prompt_seen(ids: mx.array, vocab: int) -> mx.array:
    """(V,) true for every token id of the prompt ``ids``."""
    flat = ids.reshape(-1).astype(mx.int32)
    inside = flat < vocab  # image placeholders past the vocabulary, if any
    hits = (
        mx.zeros((vocab,), dtype=mx.float32)
        .at[mx.where(inside, flat, 0)]
        .add(inside.astype(mx.float32))
    )
    return hits > 0


def penalize(
    logits: mx.array,
    rows: Sequence[Penalized],
    inputs: mx.array | None = None,
    counted: Sequence[bool] = (),
) -> mx.array:
    """``logits`` (B, V) with each row's penalties: the repetition penalty as
    vLLM defines it (over prompt and answer), then OpenAI's frequency and
    presence penalties (over the answer).

    ``inputs`` (B,): the step's input tokens; where ``counted``, the row's
    last generated token, added to its counts lazily (it may not be computed
    yet), so a step can be built before the last is read.
    """
    if not any(row.sampling.penalized for row in rows):
        return logits
    vocab = logits.shape[-1]
    zeros = mx.zeros((vocab,), dtype=mx.float32)
    counts = mx.stack([zeros if row.counts is None else row.counts for row in rows])
    if inputs is not None and any(counted):
        hits = inputs.astype(mx.int32)[:, None] == mx.arange(vocab)[None, :]
        weight = mx.array([1.0 if c else 0.0 for c in counted])[:, None]
        counts = counts + hits.astype(mx.float32) * weight
    for i, row in enumerate(rows):
        row.counts = counts[i]
    no = mx.zeros((vocab,), dtype=mx.bool_)
    seen = mx.stack([no if row.seen is None else row.seen for row in rows])
    seen = seen | (counts > 0)
    presence, frequency, repetition = (
        mx.array([getattr(row.sampling, name) for row in rows], logits.dtype)[:, None]
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    )
    penalized = mx.where(logits > 0, logits / repetition, logits * repetition)
    logits_out = mx.where(seen, penalized, logits)
    logits_out = logits_out - frequency * counts.astype(logits.dtype)
    logits_out = logits_out - presence * (counts > 0).astype(logits.dtype)
    keep = mx.array([not row.sampling.penalized for row in rows])[:, None]
    return mx.where(keep, logits, logits_out)


class GrammarMatcher:
    """One row's llguidance matcher: the text so far against its grammar
    (compiled: :meth:`~..grammars.GrammarCache.compile`)."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        llguidance = importlib.import_module("llguidance")
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self._fail_if_broken()

    def copy(self) -> GrammarMatcher:
        """A matcher in the same state: far cheaper than a new one."""
        copied = object.__new__(GrammarMatcher)
        copied.matcher = self.matcher.deep_copy()
        return copied

    def consume(self, token: int) -> None:
        """Advance past a sampled token.

        Raises:
            ValueError: The token does not continue the grammar (the mask allowed
                it: llguidance failed).
        """
        self.matcher.consume_token(token)
        self._fail_if_broken()

    def try_consume(self, token: int) -> bool:
        """Advance past ``token`` if the grammar allows it; else leave the matcher
        as it was and answer False."""
        return bool(self.matcher.try_consume_tokens([token]))

    def forced(self) -> bool:
        """Whether the grammar forces the next token, or may end here."""
        return self.matcher.is_accepting() or bool(self.matcher.compute_ff_tokens())

    def _fail_if_broken(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"the grammar failed: {self.matcher.get_error()}")


class Constrained(Protocol):
    matcher: GrammarMatcher | None
    token: int  # its last sampled token
    done: bool
    error: BaseException | None


def advance(rows: Sequence[Constrained]) -> None:
    """Advance each row's matcher past its last token; a row whose grammar fails
    is done, with the error (not the batch's)."""
    for row in rows:
        if row.matcher is not None and not row.done:
            try:
                row.matcher.consume(row.token)
            except ValueError as exc:
                row.error, row.done = exc, True


class Speculating(Protocol):
    matcher: GrammarMatcher | None
    sampling: SamplingParams  # resolved (rows.resolve_sampling)


def speculates(row: Speculating) -> bool:
    """Whether ``row``'s token can be drawn without its grammar's mask, and
    checked after: a free draw (:func:`.sampling.free_draw`) picks the
    greatest log-probability (plus the key's noise), and a mask only takes
    tokens out and moves the rest by one constant, so an allowed unmasked
    pick is the masked draw's too. Not for rows that read log-probabilities."""
    sampling = row.sampling
    return (
        row.matcher is not None
        and free_draw(sampling)
        and not sampling.logprobs
        and not sampling.top_logprobs
    )


def constrain(logits: mx.array, matchers: Sequence[GrammarMatcher | None]) -> mx.array:
    """``logits`` (B, V) with the tokens each row's grammar forbids at -inf."""
    allowed = fill_masks(matchers, logits.shape[-1])
    return logits if allowed is None else mask(logits, allowed)


def fill_masks(
    matchers: Sequence[GrammarMatcher | None], vocab: int
) -> np.ndarray | None:
    """(B, V) true where row ``i``'s grammar allows the token (every token
    without a working matcher); None when no row has a matcher."""
    if not any(matchers):
        return None
    words = (vocab + 31) // 32
    bits = np.full((len(matchers), words), -1, dtype=np.int32)
    rows = [
        (m.matcher, i)
        for i, m in enumerate(matchers)
        if m is not None and not m.matcher.is_error()
    ]
    # One call for the batch (one release of the GIL, not one per row).
    numpy_side = importlib.import_module("llguidance.numpy")
    numpy_side.fill_next_token_bitmask_par(_executor(), rows, bits)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    return allowed[:, :vocab].astype(np.bool_)


def mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))


@functools.cache
def _executor() -> Any:
    return importlib.import_module("llguidance").LLExecutor()


def new_matcher(loaded: LoadedModel, grammar: Grammar) -> GrammarMatcher:
    """A copy of the matcher the model keeps for ``grammar`` (the last
    :data:`MATCHERS_KEPT` used), made from the grammar the HTTP side compiled.

    Raises:
        ValueError: The grammar is invalid or unsupported.
    """
    kept = loaded.grammar_matchers
    template = kept.pop(grammar, None)
    if template is None:
        spelled = grammar
        if grammar.kind == "lark":
            source = special_literals(grammar.source, special_tokens(loaded))
            spelled = dataclasses.replace(grammar, source=source)
        template = GrammarMatcher(llg_tokenizer(loaded), GRAMMARS.compile(spelled))
    kept[grammar] = template  # the most recently used last
    while len(kept) > MATCHERS_KEPT:
        del kept[next(iter(kept))]
    return template.copy()


def llg_tokenizer(loaded: LoadedModel) -> Any:
    """The model's llguidance tokenizer, made once: its end-of-turn tokens are
    the model's, so a complete grammar ends the turn."""
    cached = loaded.grammar_tokenizer
    if cached is None:
        hf = importlib.import_module("llguidance.hf")
        stop = getattr(loaded.tokenizer.stopping_criteria, "eos_token_ids", None)
        cached = hf.from_tokenizer(
            loaded.tokenizer, n_vocab=loaded.vocab_size, eos_token=stop or None
        )
        loaded.grammar_tokenizer = cached
    return cached


class Banning(Protocol):
    banned: tuple[tuple[int, ...], ...]  # each bad word's token ids
    recent: list[int]  # its last generated tokens, the latest last
    done: bool


def banned_sequences(loaded: LoadedModel, words: Sequence[str]) -> list[list[int]]:
    """The token ids of each bad word as vLLM tokenizes them: the word, and the
    word after a space where that makes other tokens of the same count."""
    tokenizer = loaded.tokenizer
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def ban_words(logits: mx.array, rows: Sequence[Banning]) -> mx.array:
    """``logits`` (B, V) at -inf for each row's bad words' last tokens where the
    rest of the word was just generated (vLLM's ``bad_words``). A row's
    ``recent`` tokens must be read: such a row takes the constrained step."""
    barred: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        if row.done:
            continue
        for word in row.banned:
            head = list(word[:-1])
            if not head or row.recent[-len(head) :] == head:
                barred.append((i, word[-1]))
    if not barred:
        return logits
    mask = np.zeros(logits.shape, dtype=np.bool_)
    for i, token in barred:
        if token < logits.shape[-1]:
            mask[i, token] = True
    return mx.where(mx.array(mask), mx.array(-mx.inf, dtype=logits.dtype), logits)


def bias_rows(rows: Sequence[Biased], logits: mx.array) -> mx.array | None:
    """The rows' logit biases (B, V), each row's made once; None when no row has
    one."""
    if not any(row.sampling.logit_bias for row in rows):
        return None
    vocab = logits.shape[-1]
    zero = mx.zeros((vocab,), logits.dtype)
    for row in rows:
        bias = row.sampling.logit_bias
        if bias and row.bias_row is None:
            ids = mx.array([t for t, _ in bias], dtype=mx.int32)
            values = mx.array([b for _, b in bias], dtype=logits.dtype)
            row.bias_row = mx.zeros((vocab,), logits.dtype).at[ids].add(values)
    return mx.stack(
        [row.bias_row if row.bias_row is not None else zero for row in rows]
    )
