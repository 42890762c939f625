"""The loop that owns one model's batch: it decides every step.

:meth:`BatchLoop.turn` is the one place where a step of the batch is decided:
rows leave, requests are admitted, prompts are prefilled, the batch decodes,
and each row's output is handed to its request. It runs on the MLX thread
only, one turn per item of :meth:`BatchLoop.run`, a generator the server runs
with ``MLXThread.iterate``, so other jobs and other models get the thread
between steps. Requests never step the batch: they submit their admission
(:meth:`BatchLoop.stream`, on the event loop) and wait for their row's
output, which the loop's driver (:mod:`.driver`) routes to each one.
:meth:`BatchLoop.generate` is the same for a caller on the MLX thread: it
runs turns inline until its row has output.

The loop runs while it has work and ends when idle: a request that finds it
ended starts it again (docs/engine.md says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

from ..events import Event, FinalEvent, GenerationParams
from .answers import Item, Request, RowAnswer
from .driver import LoopDriver
from .state import BatchState

if TYPE_CHECKING:
    from PIL import Image

    from mlx_pinned import MLXThread

__all__ = ["BatchLoop"]

logger = logging.getLogger("mlx_pinned.server")


class BatchLoop(LoopDriver):
    """The scheduler of one model's batch.

    Args:
        state: The batch (:class:`~.state.BatchState`).
        thread: The MLX thread the loop runs on.
    """

    def __init__(self, state: BatchState, thread: MLXThread) -> None:
        super().__init__(thread)
        self.state = state
        self._requests: list[Request] = []  # admitted (MLX thread only)

    def generate(
        self, params: GenerationParams, images: Sequence[Image.Image]
    ) -> Generator[Event, None, None]:
        """A generation on the calling thread, which must be where the batch
        runs (the MLX thread, or any one thread for a model no loop runs):
        turns run inline while its row has no output. Closing the generator
        takes the row out at once."""
        request = Request(params, images)
        self._admit(request, time.perf_counter())
        try:
            while True:
                while not request.items:
                    self.turn()
                item = request.items.popleft()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, FinalEvent):
                    return
        finally:
            self._leave(request)

    # -- the loop (MLX thread) -------------------------------------------------

    def run(self, epoch: int) -> Generator[None, None, None]:
        """The loop: one :meth:`turn` per item, until nothing is left to do.

        Its items carry nothing: what a turn hands out waits in the outbox,
        and the item wakes the driver only when a reader is due it (see
        :meth:`_drive`); the last turn's outputs stay there for the driver.
        """
        finished = False
        try:
            while True:
                with self._lock:
                    stopping = self._stopping
                if not stopping:  # else the stream closes: the rows leave then
                    self.turn()
                with self._lock:
                    if self._idle():
                        finished = True
                        if self._epoch == epoch:
                            self._running = False
                        return
                    if self._wake > 1 and self._ended():
                        self._wake_at(1)  # an answer ended: wake the driver
                yield None
        finally:
            if not finished:  # closed by the driver, or the thread shuts down
                self._closed(epoch)

    def _closed(self, epoch: int) -> None:
        """The loop's stream was closed under it: by its driver once its last
        reader left (take the rows out; the driver starts the loop again if
        work came meanwhile), or by the thread's shutdown (fail every row)."""
        with self._lock:
            current = self._epoch == epoch
            stopping, self._stopping = self._stopping, False
            leaves, self._leaves = (self._leaves, []) if stopping else ([], [])
        if current and stopping:
            for request in leaves:
                self._leave(request)
            with self._lock:
                if self._idle():
                    self._running = False
            return
        if current:
            with self._lock:
                self._running = False
            self._abandon(RuntimeError("the batch's loop was closed"))

    def turn(self) -> None:
        """One step of the batch, and everything decided around it.

        1. Leave: the rows of closed requests are taken out (first, so a
           closed row's place is free for the admissions that follow it).
        2. Admit: each submitted request is preprocessed (chat template,
           processor) and queued for prefill; one that fails gets its error,
           and nothing else does.
        3. Step: prompts queued since the last step are prefilled (together
           where they can be, a long one a chunk per step) and join; one
           decode step runs for every row (:meth:`.decode.Decoder.step`). A
           failing step fails every row in it.
        4. Hand out: each row's new tokens become its request's events; a
           row that ended (end of turn, stop string, ``max_tokens``, error)
           leaves the batch.
        """
        with self._lock:
            leaves, self._leaves = self._leaves, []
            admissions, self._admissions = self._admissions, []
        for request in leaves:
            self._leave(request)
        now = time.perf_counter()
        for request in admissions:
            self._admit(request, now)
        if not self.state.idle():
            try:
                self.state.step()
            except Exception as exc:
                # The step failed its rows; a step that failed before it
                # reached them (a tensor-parallel leader's send) fails them here.
                logger.debug("a batch step failed", exc_info=True)
                self.state.fail(exc)
        for request in list(self._requests):
            self._hand_out(request)

    def _ended(self) -> bool:
        """Whether an answer in the outbox ended (under the lock)."""
        return any(gone for _, _, gone in self._outbox)

    def _idle(self) -> bool:
        """Whether nothing is left to do (under the lock)."""
        return (
            not (self._admissions or self._leaves or self._requests)
            and self.state.idle()
        )

    def _admit(self, request: Request, start: float) -> None:
        params = request.params
        try:
            if params.max_tokens < 1:
                raise ValueError(
                    f"max_tokens must be 1 or more, not {params.max_tokens}"
                )
            row = self.state.admit(params, request.images)
        except Exception as exc:
            self._deliver(request, (exc,), gone=True)
            return
        request.row = row
        request.answer = RowAnswer(self.state.loaded, params, row, start)
        self._requests.append(request)

    def _leave(self, request: Request) -> None:
        if request not in self._requests:
            return
        self._requests.remove(request)
        assert request.row is not None
        self.state.leave(request.row)
        self._deliver(request, (), gone=True)

    def _hand_out(self, request: Request) -> None:
        answer = request.answer
        assert answer is not None
        try:
            items, ended = answer.read()
        except Exception as exc:  # a tokenizer's failure ends its request only
            items, ended = [exc], True
        if ended:
            self._requests.remove(request)
            self.state.leave(answer.row)
        if items or ended:
            self._deliver(request, tuple(items), gone=ended)

    def _deliver(
        self, request: Request, items: tuple[Item, ...], *, gone: bool
    ) -> None:
        if request.output is None:
            request.items.extend(items)
            request.ended = request.ended or gone
            return
        with self._lock:
            request.ended = request.ended or gone
            self._outbox.append((request, items, gone))

    def _abandon(self, error: BaseException) -> None:
        """The loop stops with rows in it: fail them all. The driver fails
        the async requests; one run inline reads its error at its next turn."""
        self.state.fail(error)
        self._requests = [r for r in self._requests if r.output is None]
