"""The loop that owns one model's batch: :meth:`BatchLoop.turn` is the one
place a step is decided (docs/engine.md, "A turn, step by step"). It runs
on the MLX thread as an ``MLXThread.iterate`` stream, one turn per item;
its inbox takes requests' commands from any thread.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Generator
from typing import Literal, TypeVar

from mlx_pinned import CHECKPOINT
from mlx_pinned.types import Checkpoint

from .answers import Outputs, Request, RowAnswer
from .state import BatchState
from .step_failures import StepFailedError, end_rows, fail_all

__all__ = ["BatchLoop", "turns"]

logger = logging.getLogger("mlx_pinned.server")

Out = TypeVar("Out")


def turns(
    turn: Callable[[], Out], idle: Callable[[], bool], abandon: Callable[[], None]
) -> Generator[tuple[Out, bool] | Checkpoint, None, None]:
    """A loop's stream on the MLX thread (chat's and the encoders'): one
    ``turn`` per item, until ``idle`` after a turn. Each item is a turn's
    outputs and whether it is the last (the driver hands those out once the
    stream ended, so a request whose answer ended finds the loop stopped);
    a turn with no outputs yields ``CHECKPOINT``, which wakes no driver.
    Closed with work left, it calls ``abandon``."""
    ended = False
    try:
        while True:
            outputs = turn()
            ended = idle()
            if ended and not outputs:
                return
            yield (outputs, ended) if outputs else CHECKPOINT
            if ended:
                return
    finally:
        if not ended:
            abandon()


#: What a request asks of the loop through its inbox.
Command = Literal["admit", "leave", "whole"]


class BatchLoop:
    """The scheduler of one model's batch (MLX thread), and its inbox (any
    thread)."""

    def __init__(self, state: BatchState) -> None:
        self.state = state
        # Commands from any thread, in order.
        self._inbox: queue.SimpleQueue[tuple[Request, Command]] = queue.SimpleQueue()
        self._submitted = 0  # by the submitting side (the event loop)
        self._taken = 0  # admissions taken by a turn (MLX thread)
        self._requests: list[Request] = []  # admitted (MLX thread only)
        self._handed_early = False  # the last turn handed out, and did not step

    def submit(self, request: Request) -> None:
        """Queue ``request``'s admission for the next turn (one submitting thread:
        the event loop, or the MLX thread for a caller run inline)."""
        self._submitted += 1
        self._inbox.put((request, "admit"))

    def leave(self, request: Request) -> None:
        """Take ``request``'s row out at the next turn; any thread."""
        self._inbox.put((request, "leave"))

    def whole(self, request: Request) -> None:
        """Hand ``request``'s events out in one output, when its answer ended; any
        thread."""
        self._inbox.put((request, "whole"))

    def queued(self) -> int:
        """Requests submitted and not yet admitted; any thread."""
        return max(self._submitted - self._taken, 0)

    def waiting(self) -> bool:
        """Any thread."""
        return not self._inbox.empty()

    def run(self) -> Generator[tuple[Outputs, bool] | Checkpoint, None, None]:
        """The loop's stream (:func:`turns`), until no row is left and nothing is
        queued; closed under it, it fails every row."""
        return turns(self.turn, self._idle, self._abandon)

    def _idle(self) -> bool:
        return not self._requests and self.state.idle() and not self.waiting()

    def turn(self) -> Outputs:
        """One turn: leave, admit, step, hand out (docs/engine.md). Each
        request's new items, and whether the loop holds no row of it now.
        Admissions and leaves are handed out before the step, which a long
        prompt's prefill may make long (every other turn at most)."""
        outputs = self.take_commands()
        if outputs and not self._handed_early:
            self._handed_early = True
            return outputs
        self._handed_early = False
        if not self.state.idle():
            try:
                self.state.step()
            except Exception as exc:
                # Before it reached its rows (a tensor-parallel leader's send).
                logger.error("a batch step failed; every row ends", exc_info=exc)
                error = StepFailedError("start")
                error.__cause__ = exc
                fail_all(self.state, error)
        for request in list(self._requests):
            self._hand_out(request, outputs)
        return outputs

    def take_commands(self) -> Outputs:
        """The inbox's leaves, then its admissions (but of requests that left)."""
        admissions: list[Request] = []
        leaves: list[Request] = []
        while True:
            try:
                request, command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command == "leave":
                leaves.append(request)
            elif command == "admit":
                self._taken += 1
                admissions.append(request)
            else:
                request.whole = True
        outputs: Outputs = []
        for request in leaves:
            if request in self._requests:
                self._requests.remove(request)
                assert request.row is not None
                self.state.leave(request.row)
            if not request.ended:
                request.ended = True
                outputs.append((request, (), True))
        now = time.perf_counter()
        for request in admissions:
            if not request.ended:
                self._admit(request, now, outputs)
        return outputs

    def _admit(self, request: Request, start: float, outputs: Outputs) -> None:
        params = request.params
        try:
            # 0: the prompt's log-probabilities alone (vLLM's echo).
            scored = params.sampling.prompt_logprobs is not None
            if params.max_tokens < (0 if scored else 1):
                raise ValueError(
                    f"max_tokens must be 1 or more, not {params.max_tokens}"
                )
            row = self.state.admit(params, request.images)
        except Exception as exc:
            request.ended = True
            outputs.append((request, (exc,), True))
            return
        request.row = row
        request.answer = answer = RowAnswer(self.state.loaded, params, row, start)
        self._requests.append(request)
        taken = answer.progress()  # its first: the request was taken
        outputs.append((request, () if taken is None else (taken,), False))

    def _hand_out(self, request: Request, outputs: Outputs) -> None:
        answer = request.answer
        assert answer is not None
        # Before ``read`` takes its first token; a whole answer's reader
        # wants none past its acceptance.
        progress = None if request.whole else answer.progress()
        if progress is not None:
            outputs.append((request, (progress,), False))
        try:
            items, ended = answer.read()
        except Exception as exc:  # a tokenizer's failure ends its request only
            items, ended = [end_rows([answer.row], "hand-out", exc)], True
        if ended:
            self._requests.remove(request)
            self.state.leave(answer.row)
            request.ended = True
        if request.whole and not ended:
            request.held.extend(items)
        elif items or ended or request.held:
            outputs.append((request, (*request.held, *items), ended))
            request.held = []

    def _abandon(self) -> None:
        """The loop stops with rows in it: fail them, and drop the inbox (the
        driver fails those requests)."""
        fail_all(self.state, RuntimeError("the batch's loop was closed"))
        self._requests = []
        while True:
            try:
                _, command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._taken += command == "admit"
