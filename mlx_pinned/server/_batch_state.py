"""The decode batch of one model: prefill, one batched step, per-row sampling.

Everything here runs on the MLX thread and is touched by nothing else, so it
holds no locks. :mod:`.batching` drives it, one request generator per
sequence; this module knows only arrays, caches and rows.

Per-sequence state that mlx-vlm's Qwen-VL language models keep on the model
object (``_rope_deltas``, ``_position_ids``) is kept here per row instead: a
sequence's rope delta is captured at its prefill and every batched step
passes the deltas of all rows explicitly (``rope_deltas=(B, 1)``), together
with per-row cache offsets, so no row ever reads another's state.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ._batch_sampling import Draw, Sampled, collect, draw, vlm
from .engine import GenerationParams, LoadedModel, build_prompt

if TYPE_CHECKING:
    from PIL import Image

# mlx-vlm's default: prompts longer than this are prefilled in chunks.
_PREFILL_STEP = 2048
# Prefill inputs that matter only for media positions and rope positions,
# which a decode step of a text token recomputes the same way.
_POSITION_ONLY = frozenset(
    {
        "image_grid_thw",
        "video_grid_thw",
        "position_ids",
        "rope_deltas",
        "visual_pos_masks",
        "deepstack_visual_embeds",
    }
)


@dataclass(eq=False)
class Row:
    """One sequence: its sampling settings and where it stands.

    Attributes:
        max_tokens: Most tokens to sample.
        sampling: ``(temperature, top_p, top_k)``; temperature 0 is greedy.
        seed: Keys the sampling of every position (see :func:`_keys`).
        top_logprobs: Alternatives to return per token (0: none).
        bias: ``(token id, bias)`` pairs added to the logits.
        prompt_tokens: Tokens in the prompt, image tokens included.
        token: The last sampled token: the next step's input, not yet cached.
        sampled: Tokens sampled so far; also the next sampling position.
        pending: Sampled tokens its request has not turned into events yet.
        done: No more tokens will be sampled (end of turn or ``max_tokens``).
        left: Its request is gone; tokens still in flight for it are dropped.
        error: Why the batch failed under it, if it did.
    """

    max_tokens: int
    sampling: tuple[float, float, int]
    seed: int
    top_logprobs: int
    bias: tuple[tuple[int, float], ...]
    prompt_tokens: int = 0
    token: int = 0
    sampled: int = 0
    pending: deque[Sampled] = field(default_factory=deque)
    done: bool = False
    left: bool = False
    error: BaseException | None = None
    cache: list[Any] | None = None  # its own cache, until it joins the batch
    rope_delta: mx.array | None = None
    bias_row: mx.array | None = None


@dataclass(frozen=True)
class BatchStatistics:
    """A snapshot of one model's batch.

    Attributes:
        active: Rows in the decode batch now.
        joining: Rows prefilled and waiting for the next step to join.
        peak_active: Most rows ever decoded in one step.
        steps: Batched decode steps run.
        decoded_tokens: Tokens sampled by those steps (prefill tokens excluded).
        prefills: Prompts prefilled.
        prefill_seconds: Time spent in prefills.
        step_seconds: Time spent in decode steps.
    """

    active: int
    joining: int
    peak_active: int
    steps: int
    decoded_tokens: int
    prefills: int
    prefill_seconds: float
    step_seconds: float


class BatchState:
    """The rows of one model and their batched KV cache (MLX thread only).

    Rows enter through :meth:`prefill` (their own cache, batch size 1, the
    same operations as mlx-vlm's single-stream path), join the batch at the
    start of the next :meth:`step`, and leave through :meth:`leave` or when
    they are done; rows that left are dropped from the cache at the next
    step, or at once when none remain.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.lm: Any = loaded.model.language_model
        self.mrope = hasattr(self.lm, "_rope_deltas")
        self.rows: list[Row] = []
        self.joining: list[Row] = []
        self.leaving: set[Row] = set()
        self.cache: list[Any] | None = None
        self.deltas: mx.array | None = None
        self._bias: mx.array | None = None  # (B, V), None when no row biases
        # The step started and not yet collected: its rows and its draw.
        self._inflight: tuple[list[Row], Draw] | None = None
        self._bias_stale = True
        self._stop = loaded.tokenizer.stopping_criteria
        self.peak_active = self.steps = self.decoded = self.prefills = 0
        self.prefill_seconds = self.step_seconds = 0.0

    def statistics(self) -> BatchStatistics:
        return BatchStatistics(
            active=len(self.rows) - len(self.leaving),
            joining=len(self.joining),
            peak_active=self.peak_active,
            steps=self.steps,
            decoded_tokens=self.decoded,
            prefills=self.prefills,
            prefill_seconds=self.prefill_seconds,
            step_seconds=self.step_seconds,
        )

    # -- entering ------------------------------------------------------------

    def prefill(self, params: GenerationParams, images: Seq[Image.Image]) -> Row:
        """Prefill one prompt alone and sample its first token.

        The row joins the batch at the next step unless it is already done.
        Raises what the processor or the model raise; the batch is untouched.
        """
        start = time.perf_counter()
        v = vlm()
        loaded, lm = self.loaded, self.lm
        model, processor = loaded.model, loaded.processor
        temperature, top_p, top_k = v.resolve_sampling_defaults(
            getattr(model, "config", None),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=None,
        )
        temperature = float(v.clamp_temperature(temperature))
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        row = Row(
            max_tokens=params.max_tokens,
            sampling=(temperature, float(top_p), int(top_k or 0)),
            seed=seed,
            top_logprobs=params.top_logprobs if params.logprobs else 0,
            bias=params.logit_bias,
        )
        inputs = v.prepare_inputs(
            processor,
            images=list(images) or None,
            prompts=build_prompt(loaded, params.messages),
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=v.should_add_special_tokens(
                model.config.model_type, processor
            ),
        )
        input_ids = inputs["input_ids"]
        extra = {
            k: v
            for k, v in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        embedded = model.get_input_embeddings(
            input_ids,
            inputs.get("pixel_values"),
            mask=inputs.get("attention_mask"),
            **extra,
        )
        kwargs = {
            **extra,
            **{
                k: v
                for k, v in embedded.to_dict().items()
                if k != "inputs_embeds" and v is not None
            },
        }
        embeds = embedded.inputs_embeds
        row.prompt_tokens = int(input_ids.size)
        cache = v.make_prompt_cache(lm)
        # As mlx-vlm's generate_step: every token but the last in chunks whose
        # logits are dropped, then the last one, so the prompt's numbers are
        # exactly those of the unbatched path.
        while embeds.shape[1] > 1:
            n = min(_PREFILL_STEP, embeds.shape[1] - 1)
            lm(
                inputs=input_ids[:, :n],
                inputs_embeds=embeds[:, :n],
                cache=cache,
                n_to_process=n,
                logits_to_keep=1,
                **kwargs,
            )
            mx.eval([c.state for c in cache])
            embeds, input_ids = embeds[:, n:], input_ids[:, n:]
        if self.mrope:
            delta = kwargs.get("rope_deltas")
            if not isinstance(delta, mx.array):
                delta = lm._rope_deltas
            if delta is None:
                delta = mx.zeros((1, 1), dtype=mx.int32)
            row.rope_delta = delta.reshape(-1)[:1].reshape(1, 1)
        row.cache = cache
        last = int(input_ids[0, -1].item())
        if row.prompt_tokens > 1 and self._deferrable(last, kwargs):
            # The last prompt token is a text token: its pass is the same
            # operation as a decode step (its embedding, position offset +
            # rope delta), so it runs in the next batched step, which samples
            # the first token, instead of in a forward pass of its own.
            row.token = last
        else:
            output = lm(
                input_ids, inputs_embeds=embeds, cache=cache, logits_to_keep=1, **kwargs
            )
            logits = output.logits[:, -1, :]
            bias = self._bias_row(row, logits)[None] if row.bias else None
            pending = draw(logits, [row], bias, [c.state for c in cache])
            (first,) = collect(pending, self._stop)
            self._record(row, first)
        self.prefills += 1
        self.prefill_seconds += time.perf_counter() - start
        if row.done:
            row.cache = None
        else:
            self.joining.append(row)
        return row

    def _deferrable(self, token: int, kwargs: dict[str, Any]) -> bool:
        config = self.loaded.model.config
        media = {
            getattr(config, name, None)
            for name in (
                "image_token_index",
                "image_token_id",
                "video_token_index",
                "video_token_id",
                "audio_token_id",
            )
        }
        return token not in media and set(kwargs) <= _POSITION_ONLY

    # -- leaving -------------------------------------------------------------

    def leave(self, row: Row) -> None:
        """Take ``row`` out: now if it has not joined, else at the next step."""
        row.left = True
        if row in self.joining:
            self.joining.remove(row)
            row.cache = None
        elif row in self.rows:
            self.leaving.add(row)
            if len(self.leaving) == len(self.rows):
                self._inflight = None  # nobody is left to read it
                self._compact()

    def _compact(self) -> None:
        if not self.leaving:
            return
        keep = [i for i, row in enumerate(self.rows) if row not in self.leaving]
        self.leaving.clear()
        self._bias_stale = True
        if not keep:
            self.rows, self.cache, self.deltas = [], None, None
            mx.clear_cache()
            return
        self.rows = [self.rows[i] for i in keep]
        index = mx.array(keep, dtype=mx.int32)
        for c in self.cache or ():
            c.filter(index)
        if self.deltas is not None:
            self.deltas = self.deltas[index]

    def _join(self) -> None:
        joining, self.joining = self.joining, []
        if not joining:
            return
        self._bias_stale = True
        caches = cast("list[list[Any]]", [row.cache for row in joining])
        merged = [
            type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)
        ]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, theirs in zip(self.cache, merged, strict=True):
                mine.extend(theirs)
        if self.mrope:
            deltas = [cast("mx.array", row.rope_delta) for row in joining]
            if self.deltas is not None:
                deltas.insert(0, self.deltas)
            self.deltas = mx.concatenate(deltas, axis=0)
        for row in joining:
            row.cache = None
        self.rows.extend(joining)

    # -- decoding ------------------------------------------------------------

    def step(self) -> None:
        """One decode step for every row: one forward pass over the batch.

        Each row of the step gets one :class:`Sampled` in its ``pending``.
        Steps are pipelined: the next one is built and started before this
        returns (rows that joined meanwhile enter it; rows that left are
        dropped from it), so it computes while the thread hands out tokens.
        If a step fails, every row is failed with the error (their requests
        raise it) and the batch is emptied; the caller gets the error too.
        """
        start = time.perf_counter()
        try:
            if self._inflight is None:
                self._launch()
            inflight, self._inflight = self._inflight, None
            if inflight is None:
                return
            rows, pending = inflight
            sampled = collect(pending, self._stop)
        except BaseException as exc:
            self._fail(exc)
            raise
        for row, item in zip(rows, sampled, strict=True):
            if row.left:
                continue  # it left while the step ran
            self._record(row, item)
            self.decoded += 1
            if row.done:
                self.leaving.add(row)
        self.steps += 1
        try:
            self._launch()
        except BaseException as exc:
            self._fail(exc)
            raise
        self.step_seconds += time.perf_counter() - start

    def _launch(self) -> None:
        """Build the next step for the rows still in, and start it."""
        self._compact()
        self._join()
        rows = list(self.rows)
        if not rows:
            return
        tokens = mx.array([row.token for row in rows], dtype=mx.uint32)
        kwargs: dict[str, Any] = {}
        if self.deltas is not None:
            kwargs["rope_deltas"] = self.deltas
        output = self.lm(tokens[:, None], cache=self.cache, **kwargs)
        logits = output.logits[:, -1, :]
        bias = self._bias_matrix(rows, logits)
        states = [c.state for c in self.cache or ()]
        self._inflight = (rows, draw(logits, rows, bias, states))
        self.peak_active = max(self.peak_active, len(rows))

    def _record(self, row: Row, item: Sampled) -> None:
        row.pending.append(item)
        row.token = item.token
        row.sampled += 1
        row.done = item.eos or row.sampled >= row.max_tokens

    def _fail(self, exc: BaseException) -> None:
        for row in (*self.rows, *self.joining):
            row.error = exc
            row.done = True
            row.cache = None
        self.rows, self.joining, self.cache, self.deltas = [], [], None, None
        self._inflight = None
        self.leaving.clear()
        self._bias_stale = True

    def _bias_row(self, row: Row, logits: mx.array) -> mx.array:
        if row.bias_row is None:
            ids = mx.array([t for t, _ in row.bias], dtype=mx.int32)
            values = mx.array([b for _, b in row.bias], dtype=logits.dtype)
            row.bias_row = (
                mx.zeros((logits.shape[-1],), logits.dtype).at[ids].add(values)
            )
        return row.bias_row

    def _bias_matrix(self, rows: list[Row], logits: mx.array) -> mx.array | None:
        if self._bias_stale:
            self._bias_stale = False
            self._bias = None
            if any(row.bias for row in rows):
                zero = mx.zeros((logits.shape[-1],), logits.dtype)
                self._bias = mx.stack(
                    [self._bias_row(row, logits) if row.bias else zero for row in rows]
                )
        return self._bias
