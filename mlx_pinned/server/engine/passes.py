"""Forward passes shared by every waiting request, for the encoder kinds
(embedding, rerank): a model that maps each input, in one pass, to one row.

:meth:`PassQueue.run` is called on the event loop; every pass runs on the
MLX thread. A request's inputs join one queue, in arrival order. Each of
its turns (``MLXThread.run`` of :meth:`PassQueue._pass`) runs the inputs at
the head of the queue, whichever request they are from, as many as fit in
one pass (``batch_tokens`` padded tokens, ``batch_size`` inputs, and about
``seconds`` of work: a pass is sized from the cost per token of the ones
before, as a long prompt's prefill chunks are, :mod:`.pacing`); a request
takes turns until its own inputs are done. So requests that arrive together
share passes, and one large request never holds the MLX thread for more
than a pass at a time: a chat model's steps run between its passes, at most
about ``seconds`` apart.

Exact: the inputs of a pass are padded on the right and masked
(:func:`padded`), so an input's row is its row alone (batched equals solo
within float rounding, tests/server/test_embeddings.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from ..events import EngineCounters
from .pacing import PrefillPacer

if TYPE_CHECKING:
    from mlx_pinned import MLXThread

__all__ = [
    "BATCH_SIZE",
    "BATCH_TOKENS",
    "TOKENIZE_AT_ONCE",
    "Encoded",
    "Holding",
    "Loaded",
    "PassEngine",
    "PassQueue",
    "input_limit",
    "kv_free_counters",
    "padded",
    "queue_counters",
]

#: Padded tokens of one pass, at most (inputs times the longest of them).
BATCH_TOKENS = 8192
#: Inputs of one pass, at most.
BATCH_SIZE = 64
#: Inputs tokenized in one job of the MLX thread, at most (the thread's
#: other work runs between the jobs).
TOKENIZE_AT_ONCE = 256


class Encoded(NamedTuple):
    """One input as the model takes it: its token ids, and the segment of
    each (a pair's second text is segment 1; None: all segment 0)."""

    ids: list[int]
    types: list[int] | None = None


def padded(
    batch: Sequence[Encoded], pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch`` padded on the right with ``pad_id``: the ids, the
    attention mask (1 for a real token) and the segment ids, as int32."""
    longest = max(len(item.ids) for item in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int32)
    mask = np.zeros((len(batch), longest), dtype=np.int32)
    types = np.zeros((len(batch), longest), dtype=np.int32)
    for row, item in enumerate(batch):
        ids[row, : len(item.ids)] = item.ids
        mask[row, : len(item.ids)] = 1
        if item.types is not None:
            types[row, : len(item.types)] = item.types
    return ids, mask, types


#: A pass: the rows of a batch of inputs, one per input, on the MLX thread.
Forward = Callable[[Sequence[Encoded]], np.ndarray]


@dataclass(eq=False)
class _Job:
    """One request's inputs and their rows as passes compute them. Written
    on the MLX thread; read by its request once its own turn has run (the
    thread's FIFO orders the two)."""

    inputs: Sequence[Encoded]
    rows: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.rows = [None] * len(self.inputs)
        self.left = len(self.inputs)

    @property
    def done(self) -> bool:
        return self.left == 0 or self.error is not None


@dataclass(frozen=True, slots=True)
class _Item:
    job: _Job
    index: int


class PassQueue:
    """The one queue of an encoder model's inputs, and its passes.

    Args:
        thread: The MLX thread the model was loaded on.
        forward: Computes a batch's rows (MLX thread).
        batch_tokens: Padded tokens of one pass, at most.
        batch_size: Inputs of one pass, at most.
        seconds: About how long a pass may take (the model's
            ``prefill_step_seconds``); None: passes of ``batch_tokens``.
    """

    def __init__(
        self,
        thread: MLXThread,
        forward: Forward,
        *,
        batch_tokens: int = BATCH_TOKENS,
        batch_size: int = BATCH_SIZE,
        seconds: float | None = None,
    ) -> None:
        self.thread = thread
        self.forward = forward
        self.batch_tokens = batch_tokens
        self.batch_size = batch_size
        # Other models' streams may wait on any pass: always paced.
        self.pacer = PrefillPacer(seconds, batch_tokens)
        # The event loop appends and takes back; the MLX thread pops.
        self._lock = threading.Lock()
        self._waiting: deque[_Item] = deque()
        #: Passes run, and the inputs they ran.
        self.passes = 0
        self.done = 0

    @property
    def waiting(self) -> int:
        """Inputs in the queue; any thread."""
        return len(self._waiting)

    async def run(self, inputs: Sequence[Encoded]) -> list[np.ndarray]:
        """The rows of ``inputs``, in order, once passes ran them all.

        Event loop. Cancelling it takes its inputs not yet run out of the
        queue.

        Raises:
            Exception: What a pass with one of its inputs raised.
        """
        job = _Job(inputs)
        with self._lock:
            self._waiting.extend(_Item(job, index) for index in range(len(inputs)))
        try:
            while not job.done:
                await self.thread.run(self._pass)
        finally:
            if not job.done:  # cancelled: its inputs leave the queue
                with self._lock:
                    self._waiting = deque(i for i in self._waiting if i.job is not job)
        if job.error is not None:
            raise job.error
        return [row for row in job.rows if row is not None]

    def _take(self) -> list[_Item]:
        """The inputs at the head of the queue that fit in one pass."""
        taken: list[_Item] = []
        longest = 0
        budget = self.pacer.tokens(decoding=True)
        with self._lock:
            while self._waiting and len(taken) < self.batch_size:
                item = self._waiting[0]
                if item.job.error is not None:  # an earlier pass failed it
                    self._waiting.popleft()
                    continue
                size = len(item.job.inputs[item.index].ids)
                if taken and max(longest, size) * (len(taken) + 1) > budget:
                    break
                taken.append(self._waiting.popleft())
                longest = max(longest, size)
        return taken

    def _pass(self) -> None:
        """One pass over the inputs at the head of the queue. MLX thread. An
        error fails every request with an input in the pass."""
        taken = self._take()
        if not taken:
            return
        batch = [item.job.inputs[item.index] for item in taken]
        start = time.perf_counter()
        try:
            rows = self.forward(batch)
        except Exception as exc:
            for item in taken:
                item.job.error = exc
            return
        padded_tokens = len(batch) * max(len(item.ids) for item in batch)
        self.pacer.observe(padded_tokens, time.perf_counter() - start)
        self.passes += 1
        self.done += len(taken)
        for item, row in zip(taken, rows, strict=True):
            item.job.rows[item.index] = row
            item.job.left -= 1


def input_limit(config: dict[str, Any], tokenizer: Any) -> int:
    """Tokens of an encoder's longest input: its position embeddings, or its
    tokenizer's ``model_max_length``, the smaller (8192 where neither says;
    a tokenizer's "no limit" is a huge number, ignored)."""
    text = config.get("text_config") or config
    limits = [
        value
        for value in (
            text.get("max_position_embeddings"),
            getattr(tokenizer, "model_max_length", None),
        )
        if isinstance(value, int) and 0 < value < 10**7
    ]
    return min(limits, default=8192)


def queue_counters(queue: PassQueue) -> EngineCounters:
    """An encoder model's counters: its inputs waiting as rows, its passes
    as steps. Any thread."""
    return kv_free_counters(queue.waiting, queue.passes)


class Loaded(Protocol):
    """What a model loaded on the MLX thread tells the registry."""

    @property
    def loaded_at(self) -> float: ...

    @property
    def weight_bytes(self) -> int: ...


L = TypeVar("L", bound=Loaded)


class Holding(Generic[L]):
    """An engine of a model other than chat, that holds what it loaded as
    ``loaded`` (an embedder, a reranker, a speech model): the registry reads
    when it was loaded and its weights' bytes from there."""

    loaded: L

    @property
    def loaded_at(self) -> float:
        return self.loaded.loaded_at

    @property
    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes


class Encoder(Loaded, Protocol):
    """A model loaded on the MLX thread whose forward pass a
    :class:`PassQueue` runs."""

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray: ...


E = TypeVar("E", bound=Encoder)


class PassEngine(Holding[E]):
    """An encoder model's engine (embedding, rerank): what it loaded, and
    the queue of the passes its requests share.

    Args:
        loaded: The model.
        thread: The MLX thread it was loaded on.
        **passes: The passes' bounds (``batch_tokens``, ``batch_size``,
            ``seconds``: :class:`PassQueue`).
    """

    def __init__(self, loaded: E, thread: MLXThread, **passes: Any) -> None:
        self.loaded = loaded
        self.thread = thread
        self.queue = PassQueue(thread, loaded.forward, **passes)

    def counters(self) -> EngineCounters:
        """Inputs waiting as its rows; it holds no KV. Any thread."""
        return queue_counters(self.queue)


def kv_free_counters(rows: int, steps: int) -> EngineCounters:
    """The counters of a model that holds no KV between its steps (an
    encoder's passes, a speech model's windows)."""
    return EngineCounters(
        rows=rows,
        kv_bytes=0,
        prompt_cache_hits=0,
        prompt_cache_misses=0,
        prompt_cache_reused_tokens=0,
        prompt_cache_bytes=0,
        decode_steps=steps,
    )
