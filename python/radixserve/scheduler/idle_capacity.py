"""Idle capacity gives way between layers: the normal loop's executor on a single CPU rank.

Batch-class requests (OpenAI batch lines, priority BATCH_PRIORITY or below) run in the capacity
interactive requests leave idle. On a CPU one decode step of them takes tens of milliseconds, and
an interactive request that arrives during it used to wait for the rest of that step before its
prefill: +40% time to first token beside a running batch on the built-in model
(docs/benchmarks.md, "Batch API"). Here such a step asks, before each decoder layer, whether input
is waiting on the scheduler's socket; when it is, the step stops (StepYielded), the input is read,
a waiting prefill runs at once and its first tokens are sent, and then the stopped step runs again
from its first layer. Nothing is rolled back: the step's decode slots stay allocated and its
requests stay prepared, and the KV the stopped forward wrote is written again.

At most one yield per step: the step's second run is not asked, so a stream of arrivals cannot
starve the batch lines, and the prefills that ran meanwhile join the running batch right after it
(their requests decode together with the lines from the next step on). While the step stands
stopped, only generate requests are taken from the input; everything read after the first other
message (an abort, a control request) waits for the next step, in order, so no control request
sees a step half done.

Used where a rank reads its own socket and its forward is the module forward: one rank (no TP or
PP peers that would have to agree to stop), no speculative decoding, on CPU (on a GPU a step is
short, and the CUDA-graph decode would be given up). The overlap loop keeps its own rule
(loops.OverlapScheduleExecutor: an all-batch-class batch is processed in its own step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixserve.managers.io_struct import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput
from radixserve.model_executor.forward_batch import StepYielded
from radixserve.scheduler.loops import Finish, SyncExecutor, only_batch_class

if TYPE_CHECKING:
    from radixserve.scheduler.schedule_batch import ScheduleBatch
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

GENERATE = (TokenizedGenerateReqInput, BatchTokenizedGenerateReqInput)  # taken while a step stands stopped


class IdleCapacityExecutor(SyncExecutor):
    """SyncExecutor whose decode steps of only batch-class requests yield to waiting input.
    `has_input` says, without reading it, whether a message waits (a zero-timeout poll)."""

    def __init__(self, core: Scheduler, has_input: Callable[[], bool]) -> None:
        super().__init__(core)
        self.has_input = has_input
        self.recv: Callable[[], list[object]] = list
        self.held: list[object] = []  # read while a step stood stopped; the next step's input
        self.num_yields = 0

    def inputs(self, recv: Callable[[], list[object]]) -> Callable[[], list[object]]:
        self.recv = recv

        def next_input() -> list[object]:
            if self.held:  # what a stopped step read first, in order; the socket next step
                held, self.held = self.held, []
                return held
            return recv()

        return next_input

    def launch(self, batch: ScheduleBatch, finish: Finish) -> None:
        if not (batch.forward_mode.is_decode() and only_batch_class(batch)):
            super().launch(batch, finish)
            return
        try:
            result = self.core.run_batch(batch, should_yield=self.has_input)
            finish(batch, result)
            return
        except StepYielded:
            self._undo_launch(batch)
        self.num_yields += 1
        prefill = self._run_waiting_prefill(finish)
        finish(batch, self.core.run_batch(batch))  # the stopped step, whole this time
        if prefill is not None:
            self.core.builder.merge_prefill(prefill, self._chunked())

    def _undo_launch(self, batch: ScheduleBatch) -> None:
        """What Scheduler.launch marked, as if the step's result had come back (it will, later)."""
        self.core.note_batch_done()
        for req in batch.reqs:
            req.num_inflight -= 1

    def _run_waiting_prefill(self, finish: Finish) -> ScheduleBatch | None:
        """Read the input that stopped the step, and run the prefill it makes ready, sending its
        first tokens now."""
        msgs = self.recv()
        n = 0
        while n < len(msgs) and isinstance(msgs[n], GENERATE):
            n += 1
        self.held.extend(msgs[n:])
        if n == 0:
            return None
        core = self.core
        core.process_input_requests(msgs[:n])
        if core.pause.stops_scheduling():
            return None
        core.grammar.move_ready()
        prefill = core.builder.get_new_batch_prefill(beside_running=True)
        if prefill is None:
            return None
        logger.debug("A batch-class decode step gave way to a prefill of %d request(s)", len(prefill.reqs))
        finish(prefill, core.run_batch(prefill))
        core.output.flush()
        return prefill

    def _chunked(self) -> list:
        chunked = self.core.state.chunked_req
        return [chunked] if chunked is not None else []
