"""The prompts of one model's batch in prefill, and each step's prefill
(docs/engine.md, "Prefill scheduling"): a new prompt starts from the
prompt cache, or waits for a prompt already prefilling its prefix; the
step's plan (:mod:`.prefill_plan`) runs, storing checkpoints on the way;
a prompt whose client left may finish for the cache. MLX thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .checkpoints import Prefix, State, take
from .decode import first_tokens
from .kv_quant import KVQuant
from .model import LoadedModel
from .prefill import ChunkedPrefill, Prefilled, batchable, prefill_together
from .prefill_plan import MIN_CHUNK, Limits, PrefillPacer, Waiting, plan
from .prompt_cache import Key, PromptCache, common_prefix
from .rows import Row
from .step_failures import end_rows

if TYPE_CHECKING:
    from .batch_statistics import Tally
    from .model_inputs import Prepared

__all__ = ["PREFILL_BATCH", "Prefills", "Prompt", "store_row"]

# Prompts prefilled together at most (mlx-vlm's default prefill batch).
PREFILL_BATCH = 8
#: The fewest tokens worth waiting for another prompt's prefill to reach.
SHARE_LEAST = MIN_CHUNK


@dataclass(eq=False)
class Prompt:
    """A row in prefill.

    Attributes:
        prefix: Its start from the prompt cache, until its job starts.
        looked_up: The cache was read for it (else it is new, or waits).
        together: It runs whole, in a padded pass with others.
        provider: The prompt whose prefill it waits to reach ``shared``.
        stops: Positions its chunks end at, to store a checkpoint there;
            ``stored``: those stored (a waiting prompt finds its own there).
        abandoned: Its client left; it finishes for the prompt cache.
    """

    row: Row
    arrival: int
    job: ChunkedPrefill | None = None
    prefix: Prefix | None = None
    looked_up: bool = False
    together: bool = False
    provider: Prompt | None = None
    shared: int = 0
    stops: set[int] = field(default_factory=set)
    stored: set[int] = field(default_factory=set)
    abandoned: bool = False

    @property
    def position(self) -> int:
        """Prompt tokens its cache holds."""
        if self.job is not None:
            return self.job.position
        return 0 if self.prefix is None else self.prefix.length

    def left(self) -> int:
        """Tokens its chunks have yet to run (its last is a decode step's)."""
        if self.job is not None:
            return max(self.job.left - 1, 0)
        return max(self.row.prompt_tokens - self.position - 1, 0)


def store_row(
    cache: PromptCache, key: Key, caches: Any, index: int | None, *, disk: bool = True
) -> bool:
    """Cache row ``index`` of batch ``caches`` (None: a single sequence's)
    under as much of ``key`` as it holds (a model that keeps states: all it
    holds, or nothing); a failure is logged, and the row goes on. Whether an
    entry was made. ``disk``: written to the disk tier too."""
    try:
        taken = take(caches, index)
        if taken is None or not taken[0]:
            return False
        tokens, layers = taken
        if tokens > len(key) and any(isinstance(x, State) for x in layers):
            return False
        cache.store(key[:tokens], layers, disk=disk)
    except Exception as exc:
        end_rows((), "prompt cache store", exc)
        return False
    return True


@dataclass
class PrefillSettings:
    """How a batch prefills. ``step``: a chunk's most tokens; ``checkpoint``:
    a model that keeps states checkpoints a long prefill every so many tokens
    (0: never); ``abandoned``: a prompt whose client left with at most so
    many tokens left finishes for the cache (0: none does)."""

    step: int
    checkpoint: int
    abandoned: int
    exclusive: bool
    quant: KVQuant | None


class Prefills:
    """The prompts in prefill, oldest first. ``joined``: called with the rows
    a pass prefilled and their cache, to join the batch (rows whose client
    left are not given)."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache: PromptCache,
        pacer: PrefillPacer,
        settings: PrefillSettings,
        tally: Tally,
        joined: Callable[[list[Row], Prefilled], None],
        states: bool,
    ) -> None:
        self.loaded, self.cache, self.pacer = loaded, cache, pacer
        self.settings, self.tally, self.joined = settings, tally, joined
        self.states = states  # the model keeps states: they checkpoint
        self.prompts: list[Prompt] = []
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, row: Row) -> None:
        self._arrivals += 1
        self.prompts.append(Prompt(row, self._arrivals))

    def rows(self, *, live: bool = False) -> list[Row]:
        return [p.row for p in self.prompts if not (live and p.row.gone)]

    def started(self) -> list[tuple[Row, ChunkedPrefill]]:
        """The rows prefilled a chunk at a time, and their jobs."""
        return [(p.row, p.job) for p in self.prompts if p.job is not None]

    def clear(self) -> list[Row]:
        rows = self.rows()
        self.prompts = []
        return rows

    def leave(self, row: Row) -> bool:
        """``row``'s client left: drop its prompt, or keep it to finish for the
        cache at the lowest priority (a started one near enough its end).
        Whether it held the row."""
        prompt = next((p for p in self.prompts if p.row is row), None)
        if prompt is None:
            return False
        settings = self.settings
        if (
            prompt.job is not None
            and row.key is not None
            and self.cache.enabled
            and not settings.exclusive
            and prompt.left() <= settings.abandoned
        ):
            prompt.abandoned = True
        else:
            self.prompts.remove(prompt)
        return True

    def step(self, *, decoding: bool, busy: bool) -> list[Row]:
        """This step's prefill (``decoding``: rows wait on it; ``busy``: the
        batch holds rows, which holds a new prompt of an ``exclusive``
        batch); the rows whose prefill ended here, with their first token or
        their error."""
        self._start(busy)
        waiting = [p for p in self.prompts if p.looked_up or p.provider is not None]
        index = {id(p): i for i, p in enumerate(waiting)}
        seen = [
            Waiting(
                p.left(),
                p.row.priority,
                p.arrival,
                p.together,
                p.abandoned,
                None if p.provider is None else index[id(p.provider)],
            )
            for p in waiting
        ]
        # A prompt that ends in the step waits on it, as decoding rows do.
        waits = decoding or len([w for w in seen if w.provider is None]) > 1
        tokens = self.pacer.tokens(decoding=waits or any(w.together for w in seen))
        step = plan(seen, Limits(tokens, self.settings.step, MIN_CHUNK))
        began = time.perf_counter()
        ended: list[Row] = []
        self._together([waiting[i] for i in step.together], ended)
        for n, (i, tokens) in enumerate(step.runs):
            if n and self.pacer.spent(time.perf_counter() - began):
                break
            self._run(waiting[i], tokens, ended)
        return ended

    def _start(self, busy: bool) -> None:
        """Look up the new prompts, and those whose wait is over; a new one that
        shares more with a prompt in prefill than the cache holds waits for it."""
        live = [p for p in self.prompts if not p.row.gone or p.abandoned]
        self.prompts = live
        for prompt in live:
            if prompt.looked_up:
                continue
            provider = prompt.provider
            if provider is not None:
                if provider in live and prompt.shared not in provider.stored:
                    continue  # still on its way
                prompt.provider = None
            elif self.settings.exclusive and (busy or any(p.looked_up for p in live)):
                continue  # one row at a time: the next once the batch is empty
            else:
                self.tally.prefills += 1
                if self._wait(prompt):
                    continue
            self._look_up(prompt)

    def _wait(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` waits for another's prefill (set up if so)."""
        key = prompt.row.key
        if key is None or self.settings.exclusive or not self.cache.enabled:
            return False
        best, shared = None, 0
        for other in self.prompts:
            if other is prompt or other.together or other.row.key is None:
                continue
            if other.provider is not None or not (other.looked_up or other.job):
                continue
            end = len(other.row.key) - 1
            common = common_prefix(other.row.key, key, min(len(key) - 1, end), shared)
            # A model that keeps states: only where its chunks still stop.
            reachable = other.position <= common or common == end or not self.states
            if common > shared and reachable:
                best, shared = other, common
        cached = self.cache.longest(key, len(key) - 1)
        if best is None or shared < cached + SHARE_LEAST:
            return False
        prompt.provider, prompt.shared = best, shared
        best.stops.add(shared)
        if best.job is not None and best.position >= shared:
            self._checkpoint(best, shared)  # there now, or past it: cut its KV
        return True

    def _look_up(self, prompt: Prompt) -> None:
        """Read the prompt cache for ``prompt``: it starts from what is there."""
        row = prompt.row
        prompt.looked_up = True
        try:
            prompt.prefix = self._reuse(row)
        except Exception as exc:
            end_rows([row], "prompt cache lookup", exc)
            self.prompts.remove(prompt)
            return
        prepared = _prepared(row)
        prompt.together = (
            not self.settings.exclusive
            and prompt.prefix is None
            and batchable(self.loaded, prepared, self.settings.step)
        )

    def _reuse(self, row: Row) -> Prefix | None:
        """The cached longest prefix of ``row``'s prompt but its last token,
        which is run for its first token's logits; none for a scored prompt
        (a cached prefix has no scores)."""
        if row.key is None or row.sampling.prompt_logprobs is not None:
            return None
        prefix = self.cache.lookup(row.key, len(row.key) - 1)
        row.cached = prefix.length
        return prefix if prefix.length else None

    def _together(self, prompts: list[Prompt], ended: list[Row]) -> None:
        """Prefill ``prompts`` whole, a prefill batch's worth a pass; those of a
        pass that fails run alone (then only the failing one fails)."""
        for i in range(0, len(prompts), PREFILL_BATCH):
            group = prompts[i : i + PREFILL_BATCH]
            rows = [p.row for p in group]
            self.tally.prefill_passes += 1
            try:
                prefilled = prefill_together(
                    self.loaded, [_prepared(r) for r in rows], self.settings.quant
                )
                first_tokens(rows, prefilled)
            except Exception:  # find the culprit: each alone (none sampled yet)
                for prompt in group:
                    prompt.together = False
                continue
            for prompt in group:
                self.prompts.remove(prompt)
            self.joined(rows, prefilled)
            ended += rows

    def _run(self, prompt: Prompt, tokens: int, ended: list[Row]) -> None:
        """Run ``prompt``'s next chunk, of ``tokens`` at most, up to its next
        stop; at a stop, store its checkpoint."""
        row = prompt.row
        self.tally.prefill_passes += 1
        try:
            if prompt.job is None:
                prompt.job = ChunkedPrefill(
                    self.loaded,
                    _prepared(row),
                    prompt.prefix,
                    self.settings.step,
                    self.settings.quant,
                )
                prompt.prefix = None
            job = prompt.job
            at = job.position
            stop = self._next_stop(prompt)
            if stop is not None:
                tokens = min(tokens, stop - at)
            start = time.perf_counter()
            group = job.advance(max(tokens, 1))
            row.prefilled = job.position  # progress reports
            if group is None:
                self.pacer.observe(job.position - at, time.perf_counter() - start)
                if job.position == stop:
                    self._checkpoint(prompt, stop)
                return
            if not row.gone:
                first_tokens([row], group)
        except Exception as exc:
            end_rows([row], "prefill", exc)
        else:
            self.joined([row], group)
        self.prompts.remove(prompt)
        ended.append(row)

    def _next_stop(self, prompt: Prompt) -> int | None:
        at = prompt.position
        stops = [s for s in prompt.stops if s > at]
        every = self.settings.checkpoint
        if self.states and every and prompt.row.key is not None:
            stops.append((at // every + 1) * every)
        return min(stops, default=None)

    def _checkpoint(self, prompt: Prompt, at: int) -> None:
        """Store ``prompt``'s first ``at`` tokens (its job holds at least as many;
        more only for a model that keeps no states), in memory only: the
        prompt's own entry, written to disk at its end, keeps its states."""
        key, job = prompt.row.key, prompt.job
        if key is None or job is None or (job.position != at and self.states):
            return
        if store_row(self.cache, key[:at], job.cache, None, disk=False):
            prompt.stored.add(at)


def _prepared(row: Row) -> Prepared:
    assert row.prepared is not None
    return row.prepared
