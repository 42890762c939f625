"""The encoder kinds' loop (embedding, rerank): forward passes that every
waiting request's inputs share (docs/engine.md, "Other kinds").
:class:`PassLoop` runs on the MLX thread, :class:`PassDriver` on the event
loop. Inputs are padded on the right and masked, so an input's row is the
same alone or batched.
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

from ..resident import EngineCounters
from .driver import Driver
from .loop import turns
from .prefill_plan import PrefillPacer

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
    """One input as the model takes it: its token ids, and the segment of each
    (None: all segment 0)."""

    ids: list[int]
    types: list[int] | None = None


def padded(
    batch: Sequence[Encoded], pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch`` padded on the right with ``pad_id``: the ids, the attention mask
    and the segment ids, as int32."""
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
    """One request's inputs, and its rows as its driver hands them over. Event
    loop; the loop reads only its inputs."""

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
    """The loop of one encoder model's passes (MLX thread), and its inbox (any
    thread). Each turn runs one pass over the inputs at the head of its
    queue, whichever request they are from.

    Args:
        seconds: About how long a pass may take, sized by the cost per token
            of the passes before (:class:`.PrefillPacer`); None: ``batch_tokens``.
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
        self.passes = 0

    def submit(self, job: Job) -> None:
        """Any thread."""
        self._inbox.put((job, "admit"))

    def leave(self, job: Job) -> None:
        """Take ``job``'s inputs not yet run out at the next turn; any thread."""
        self._inbox.put((job, "leave"))

    def waiting(self) -> bool:
        """Any thread."""
        return not self._inbox.empty()

    def run(self) -> Generator[tuple[PassOutputs, bool] | Checkpoint, None, None]:
        return turns(self.turn, self._idle, self._abandon)

    def turn(self) -> PassOutputs:
        """The inbox's commands, then one pass over the inputs at the head of the
        queue. A pass that fails fails each request with an input in it, and no
        other."""
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
        """Closed with inputs queued: drop them and the inbox (the driver fails
        their requests)."""
        self._queue.clear()
        while not self._inbox.empty():
            self._inbox.get_nowait()


class PassDriver(Driver[PassLoop, PassOutputs]):
    """The event-loop side of an encoder model's loop: a request submits its
    inputs and waits for its rows. Event loop only; :attr:`pending` any
    thread."""

    def __init__(self, loop: PassLoop, thread: MLXThread) -> None:
        super().__init__(loop, thread)
        self._live: set[Job] = set()  # submitted, not yet ended
        #: Inputs submitted whose rows are not yet handed over.
        self.pending = 0

    async def rows(self, inputs: Sequence[Encoded]) -> list[np.ndarray]:
        """The rows of ``inputs``, in order; cancelling it takes its inputs not yet
        run out of the loop's queue.

        Raises:
            MLXThreadClosedError: The thread is closed.
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
    """Tokens of an encoder's longest input: its position embeddings or its
    tokenizer's ``model_max_length``, the smaller (8192 where neither says)."""
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
    ``loaded``: the registry reads its load time and weight bytes there."""

    loaded: L

    @property
    def loaded_at(self) -> float:
        return self.loaded.loaded_at

    @property
    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes


class Encoder(Loaded, Protocol):
    """A model loaded on the MLX thread whose forward pass a :class:`PassLoop`
    runs."""

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray: ...


E = TypeVar("E", bound=Encoder)
T = TypeVar("T")


class PassEngine(Holding[E]):
    """An encoder model's engine: what it loaded, and the loop of the passes its
    requests share, with its driver. ``passes``: :class:`PassLoop`'s bounds."""

    def __init__(self, loaded: E, thread: MLXThread, **passes: Any) -> None:
        self.loaded = loaded
        self.thread = thread
        self.loop = PassLoop(loaded.forward, **passes)
        self.driver = PassDriver(self.loop, thread)

    def counters(self) -> EngineCounters:
        """Inputs waiting as its rows, passes as its steps; any thread."""
        return kv_free_counters(self.driver.pending, self.loop.passes)

    async def tokenized(
        self, tokenize: Callable[[Sequence[T]], list[Encoded]], items: Sequence[T]
    ) -> list[Encoded]:
        """``tokenize`` over ``items`` on the MLX thread, a job per
        :data:`TOKENIZE_AT_ONCE` of them. Event loop."""
        found: list[Encoded] = []
        for first in range(0, len(items), TOKENIZE_AT_ONCE):
            chunk = items[first : first + TOKENIZE_AT_ONCE]
            found += await self.thread.run(tokenize, chunk)
        return found


def kv_free_counters(rows: int, steps: int) -> EngineCounters:
    """The counters of a model that holds no KV between its steps (an encoder's
    passes, a speech model's windows)."""
    return EngineCounters(
        rows=rows,
        kv_bytes=0,
        prompt_cache_hits=0,
        prompt_cache_misses=0,
        prompt_cache_reused_tokens=0,
        prompt_cache_bytes=0,
        decode_steps=steps,
    )
