"""Forward passes shared by every waiting request, for the encoder kinds
(embedding, rerank): a model that maps each input, in one pass, to one row.

An encoder model batches through a loop of its own, on the pattern of
chat's (docs/engine.md): :class:`PassLoop` runs on the MLX thread as one
``MLXThread.iterate`` stream (:func:`~.loop.turns`), started by the first
request and ended when idle. Each turn takes the inputs at the head of its
queue, whichever request they are from, as many as fit in one pass
(``batch_tokens`` padded tokens, ``batch_size`` inputs, and about
``seconds`` of work: a pass is sized from the cost per token of the ones
before, as a long prompt's prefill chunks are, :mod:`.pacing`), and yields
the pass's rows. Its driver (:class:`PassDriver`, on the event loop) hands
each request its rows. So requests that arrive together share passes, and
a chat model's steps run between passes, at most about ``seconds`` apart.

Exact: the inputs of a pass are padded on the right and masked
(:func:`padded`), so an input's row is its row alone (batched equals solo
within float rounding, tests/server/test_embeddings.py).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Collection, Generator, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    NamedTuple,
    Protocol,
    TypeVar,
    cast,
)

import anyio
import numpy as np

from ..events import EngineCounters
from .driver import Driver
from .loop import turns
from .pacing import PrefillPacer

if TYPE_CHECKING:
    from mlx_pinned import MLXThread
    from mlx_pinned.types import Checkpoint

__all__ = [
    "BATCH_SIZE",
    "BATCH_TOKENS",
    "TOKENIZE_AT_ONCE",
    "Encoded",
    "Holding",
    "Job",
    "Loaded",
    "PassDriver",
    "PassEngine",
    "PassLoop",
    "input_limit",
    "kv_free_counters",
    "padded",
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


class Job:
    """One request's inputs, and its rows as its driver hands them over.
    Event loop; the loop reads only its inputs."""

    __slots__ = ("done", "error", "inputs", "left", "rows")

    def __init__(self, inputs: Sequence[Encoded]) -> None:
        self.inputs = inputs
        self.rows: list[np.ndarray | None] = [None] * len(inputs)
        self.left = len(inputs)  # rows not yet handed over
        self.error: Exception | None = None
        self.done = anyio.Event()


#: What a request asks of the loop through its inbox.
Command = Literal["admit", "leave"]

#: A turn's outputs: each request with an input in its pass, and its rows
#: by index, or the error of the pass.
PassOutputs = list[tuple[Job, list[tuple[int, np.ndarray]] | Exception]]


class PassLoop:
    """The loop of one encoder model's passes (MLX thread), and its inbox
    (any thread).

    Args:
        forward: Computes a batch's rows (MLX thread).
        batch_tokens: Padded tokens of one pass, at most.
        batch_size: Inputs of one pass, at most.
        seconds: About how long a pass may take (the model's
            ``prefill_step_seconds``); None: passes of ``batch_tokens``.
    """

    def __init__(
        self,
        forward: Forward,
        *,
        batch_tokens: int = BATCH_TOKENS,
        batch_size: int = BATCH_SIZE,
        seconds: float | None = None,
    ) -> None:
        self.forward = forward
        self.batch_tokens = batch_tokens
        self.batch_size = batch_size
        # Other models' streams may wait on any pass: always paced.
        self.pacer = PrefillPacer(seconds, batch_tokens)
        self._inbox: queue.SimpleQueue[tuple[Job, Command]] = queue.SimpleQueue()
        self._queue: deque[tuple[Job, int]] = deque()  # MLX thread only
        #: Passes run.
        self.passes = 0

    def submit(self, job: Job) -> None:
        """Queue ``job``'s inputs at the next turn; any thread."""
        self._inbox.put((job, "admit"))

    def leave(self, job: Job) -> None:
        """Take ``job``'s inputs not yet run out at the next turn; any
        thread."""
        self._inbox.put((job, "leave"))

    def waiting(self) -> bool:
        """Whether a command waits for a turn; any thread."""
        return not self._inbox.empty()

    def run(self) -> Generator[tuple[PassOutputs, bool] | Checkpoint, None, None]:
        """The loop's stream (:func:`~.loop.turns`): one :meth:`turn` per
        item, until no input is queued."""
        return turns(self.turn, self._idle, self._abandon)

    def turn(self) -> PassOutputs:
        """The inbox's commands, in order, then one pass over the inputs at
        the head of the queue. A pass that fails fails each request with an
        input in it, and no other: their inputs leave the queue."""
        while not self._inbox.empty():
            job, command = self._inbox.get_nowait()
            if command == "admit":
                self._queue.extend((job, index) for index in range(len(job.inputs)))
            else:
                self._drop({job})
        taken = self._take()
        if not taken:
            return []
        batch = [job.inputs[index] for job, index in taken]
        start = time.perf_counter()
        try:
            rows = self.forward(batch)
        except Exception as exc:
            failed = dict.fromkeys(job for job, _ in taken)
            self._drop(failed.keys())
            return [(job, exc) for job in failed]
        padded_tokens = len(batch) * max(len(item.ids) for item in batch)
        self.pacer.observe(padded_tokens, time.perf_counter() - start)
        self.passes += 1
        handed: dict[Job, list[tuple[int, np.ndarray]]] = {}
        for (job, index), row in zip(taken, rows, strict=True):
            handed.setdefault(job, []).append((index, row))
        return list(handed.items())

    def _take(self) -> list[tuple[Job, int]]:
        """The inputs at the head of the queue that fit in one pass."""
        taken: list[tuple[Job, int]] = []
        longest = 0
        budget = self.pacer.tokens(decoding=True)
        while self._queue and len(taken) < self.batch_size:
            job, index = self._queue[0]
            size = len(job.inputs[index].ids)
            if taken and max(longest, size) * (len(taken) + 1) > budget:
                break
            taken.append(self._queue.popleft())
            longest = max(longest, size)
        return taken

    def _drop(self, jobs: Collection[Job]) -> None:
        self._queue = deque(item for item in self._queue if item[0] not in jobs)

    def _idle(self) -> bool:
        return not self._queue and not self.waiting()

    def _abandon(self) -> None:
        """Closed with inputs queued: drop them, and the inbox's commands
        (the driver fails their requests)."""
        self._queue.clear()
        while not self._inbox.empty():
            self._inbox.get_nowait()


class PassDriver(Driver[PassLoop, PassOutputs]):
    """The event-loop side of an encoder model's loop: a request submits
    its inputs and waits for its rows; the driver task (:class:`~.driver.
    Driver`) hands them over. Event loop only; :attr:`pending` any thread.

    Args:
        loop: The model's loop.
        thread: The MLX thread it runs on.
    """

    def __init__(self, loop: PassLoop, thread: MLXThread) -> None:
        super().__init__(loop, thread)
        self._live: set[Job] = set()  # submitted, not yet ended
        #: Inputs submitted whose rows are not yet handed over.
        self.pending = 0

    async def rows(self, inputs: Sequence[Encoded]) -> list[np.ndarray]:
        """The rows of ``inputs``, in order, once passes ran them all.
        Cancelling it takes its inputs not yet run out of the loop's queue
        (at its next turn, before its next pass).

        Raises:
            MLXThreadClosedError: The thread is closed (raised at once).
            MLXThreadBusyError: The thread's queue is full.
            Exception: What a pass with one of its inputs raised.
        """
        if not inputs:
            return []
        job = Job(inputs)
        self.loop.submit(job)
        try:
            self.start()
        except BaseException:
            self.loop.leave(job)
            raise
        self._live.add(job)
        self.pending += len(inputs)
        try:
            await job.done.wait()
        finally:
            if job in self._live:  # cancelled: its inputs leave the queue
                self.loop.leave(job)
                self._end(job)
        if job.error is not None:
            raise job.error
        return cast("list[np.ndarray]", job.rows)

    def _route(self, outputs: PassOutputs) -> None:
        for job, handed in outputs:
            if job not in self._live:  # it left
                continue
            if isinstance(handed, Exception):
                self._end(job, handed)
                continue
            for index, row in handed:
                job.rows[index] = row
            job.left -= len(handed)
            self.pending -= len(handed)
            if job.left == 0:
                self._end(job)

    def _fail(self, error: Exception) -> None:
        for job in list(self._live):
            self._end(job, error)

    def _end(self, job: Job, error: Exception | None = None) -> None:
        self._live.discard(job)
        self.pending -= job.left
        job.error = error
        job.done.set()


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
    :class:`PassLoop` runs."""

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray: ...


E = TypeVar("E", bound=Encoder)


class PassEngine(Holding[E]):
    """An encoder model's engine (embedding, rerank): what it loaded, and
    the loop of the passes its requests share, with its driver.

    Args:
        loaded: The model.
        thread: The MLX thread it was loaded on.
        **passes: The passes' bounds (``batch_tokens``, ``batch_size``,
            ``seconds``: :class:`PassLoop`).
    """

    def __init__(self, loaded: E, thread: MLXThread, **passes: Any) -> None:
        self.loaded = loaded
        self.thread = thread
        self.loop = PassLoop(loaded.forward, **passes)
        self.driver = PassDriver(self.loop, thread)

    def counters(self) -> EngineCounters:
        """Inputs waiting as its rows, passes as its steps; it holds no KV.
        Any thread."""
        return kv_free_counters(self.driver.pending, self.loop.passes)


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
