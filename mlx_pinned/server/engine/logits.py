"""What a row does to its logits before sampling: penalties and grammars.

MLX thread only. Both act per row, on the (B, V) logits of a step:

- penalties (:func:`penalize`): the repetition penalty over the tokens of
  the prompt and of the answer so far (vLLM's definition: positive logits
  divided by it, negative ones multiplied), then OpenAI's frequency and
  presence penalties over the answer so far. A row's token counts are an
  MLX array updated inside each step's graph from that step's input tokens,
  so a step can still be built before the previous one was read;
- grammars (:class:`GrammarMatcher`, :func:`constrain`): llguidance matches
  the text so far and masks every token that cannot continue it; once the
  grammar is complete only an end of turn is allowed. The mask of a step
  needs the previous step's token: a batch with a constrained row starts
  each forward pass before that token is read and masks its logits after
  (see ``BatchState.step``), so the matchers advance while it computes.
  A row that reads no log-probabilities and draws greedily or by
  temperature alone skips its mask where its grammar leaves the choice
  open (:func:`speculates`): its token is checked when read, and drawn
  again with the mask only where the grammar refuses it.

A row without either pays nothing: the batch skips the work when no row
asks for it.
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
    """What the logit bias reads and writes of a row."""

    sampling: SamplingParams  # its logit_bias: (token id, bias) pairs
    bias_row: mx.array | None  # (V,) made on first use


class Penalized(Protocol):
    """What the penalties read and write of a row."""

    sampling: SamplingParams  # its penalties
    counts: mx.array | None  # (V,) times each token was generated so far
    seen: mx.array | None  # (V,) tokens of the prompt


def prompt_seen(ids: mx.array, vocab: int) -> mx.array:
    """(V,) true for every token id in ``ids`` (the prompt)."""
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
    """``logits`` (B, V) with each row's penalties applied.

    ``inputs`` (B,) are the step's input tokens: for rows where ``counted``
    is true they are the row's last generated token, added to its counts
    first (lazily: the token may not be computed yet). Rows without
    penalties are left as they are, exactly.
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
    # Rows without penalties keep their logits bit for bit.
    keep = mx.array([not row.sampling.penalized for row in rows])[:, None]
    return mx.where(keep, logits, logits_out)


class GrammarMatcher:
    """One row's llguidance matcher: the text so far against its grammar.

    Attributes:
        matcher: llguidance's ``LLMatcher``.

    Args:
        tokenizer: The model's llguidance tokenizer (:func:`llg_tokenizer`).
        grammar: The compiled grammar (:meth:`~..grammars.GrammarCache.compile`).
    """

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        llguidance = importlib.import_module("llguidance")
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self._fail_if_broken()

    def copy(self) -> GrammarMatcher:
        """A matcher in the same state (llguidance builds a new matcher's
        parser from the grammar's text: 0.7 ms for a small schema on this
        machine; a copy takes microseconds)."""
        copied = object.__new__(GrammarMatcher)
        copied.matcher = self.matcher.deep_copy()
        return copied

    def consume(self, token: int) -> None:
        """Advance past a sampled token.

        Raises:
            ValueError: The token does not continue the grammar (the mask
                allowed it, so llguidance failed).
        """
        self.matcher.consume_token(token)
        self._fail_if_broken()

    def try_consume(self, token: int) -> bool:
        """Advance past ``token`` if the grammar allows it; else leave the
        matcher as it was and answer False."""
        return bool(self.matcher.try_consume_tokens([token]))

    def forced(self) -> bool:
        """Whether the grammar forces the next token, or may end here."""
        return self.matcher.is_accepting() or bool(self.matcher.compute_ff_tokens())

    def _fail_if_broken(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"the grammar failed: {self.matcher.get_error()}")


class Constrained(Protocol):
    """What advancing a grammar reads and writes of a row."""

    matcher: GrammarMatcher | None
    token: int  # its last sampled token
    done: bool
    error: BaseException | None


def advance(rows: Sequence[Constrained]) -> None:
    """Advance the matcher of each row that is not done past its last token.

    A row whose grammar fails is done, with the error: its own failure, not
    the batch's. (llguidance's parallel ``consume_token_par`` hands the
    rows to its worker threads: not reliably faster than this loop on two
    cores, and slower under load.)
    """
    for row in rows:
        if row.matcher is not None and not row.done:
            try:
                row.matcher.consume(row.token)
            except ValueError as exc:
                row.error, row.done = exc, True


class Speculating(Protocol):
    """What deciding whether a row's grammar can speculate reads of it."""

    matcher: GrammarMatcher | None
    sampling: SamplingParams  # resolved (rows.resolve_sampling)


def speculates(row: Speculating) -> bool:
    """Whether ``row``'s token can be drawn without its grammar's mask, and
    checked after.

    A draw picks the greatest of the log-probabilities (greedy) or of them
    plus noise from the row's key (temperature alone: the Gumbel-max draw
    of ``mx.random.categorical``). A mask only takes tokens out and moves
    every log-probability by one constant, so when the unmasked pick is
    allowed, the masked draw picks it too (the same key, the same noise);
    when it is not, the row is drawn again with the mask. Most tokens of a
    constrained answer (inside a string, say) are allowed, and checking one
    costs a few microseconds against a mask's tens per row. Not for rows
    whose candidate set depends on the mask (:func:`.sampling.free_draw`),
    nor for rows that read log-probabilities: those are the masked
    distribution's.
    """
    sampling = row.sampling
    return (
        row.matcher is not None
        and free_draw(sampling)
        and not sampling.logprobs
        and not sampling.top_logprobs
    )


def constrain(logits: mx.array, matchers: Sequence[GrammarMatcher | None]) -> mx.array:
    """``logits`` (B, V) with the tokens each row's grammar forbids at -inf;
    rows without a matcher are left as they are."""
    allowed = fill_masks(matchers, logits.shape[-1])
    return logits if allowed is None else mask(logits, allowed)


def fill_masks(
    matchers: Sequence[GrammarMatcher | None], vocab: int
) -> np.ndarray | None:
    """(B, V) true where row ``i``'s grammar allows the token; rows without
    a matcher, or whose grammar failed, allow every token. None when no row
    has a matcher."""
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
    """``logits`` (B, V) at -inf where ``allowed`` (B, V) is false."""
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))


@functools.cache
def _executor() -> Any:
    """llguidance's executor for batch masks (its default thread count)."""
    return importlib.import_module("llguidance").LLExecutor()


def new_matcher(loaded: LoadedModel, grammar: Grammar) -> GrammarMatcher:
    """A fresh matcher for ``grammar``: a copy of one the model keeps per
    grammar (the last :data:`MATCHERS_KEPT` used), made from the grammar the
    HTTP side compiled (:data:`~..grammars.GRAMMARS`), not compiled again.

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
    """The model's llguidance tokenizer, made once: its end-of-turn tokens
    are the model's, so a complete grammar ends the turn."""
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
    """What barring a row's bad words reads of it."""

    banned: tuple[tuple[int, ...], ...]  # each bad word's token ids
    recent: list[int]  # its last generated tokens, the latest last
    done: bool


def banned_sequences(loaded: LoadedModel, words: Sequence[str]) -> list[list[int]]:
    """The token ids of each bad word, as vLLM tokenizes them: the word, and
    with a space before it where that makes other tokens of the same count
    (a word at the start of the text and one inside it)."""
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
    """``logits`` (B, V) at -inf for each row's bad words' last tokens where
    the rest of the word was just generated (vLLM's ``bad_words``); rows
    without any are left as they are, exactly. A row's ``recent`` tokens
    must be read: a batch with such a row runs the constrained step."""
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
    """The rows' logit biases (B, V); None when no row has one. Each row's
    (V,) bias is made once and kept on it."""
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
