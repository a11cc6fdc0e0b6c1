"""The scheduler's event loops: NormalLoop (seed 001 §2.1) and OverlapLoop (§2.2).

Each `step(recv_reqs)` dispatches the received requests, builds and runs at most one batch and
processes results; Scheduler.event_loop runs one of them forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from radixserve.scheduler.overlap import FutureMap, PendingResult, create_overlap_executor
from radixserve.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler


class NormalLoop:
    """event_loop_normal (seed 001 §2.1): build, run, process; the CPU waits for each forward."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def step(self, recv_reqs: Iterable[object] = ()) -> None:
        s = self.scheduler
        s.process_input_requests(recv_reqs)
        batch = s.get_next_batch_to_run()
        if batch is not None:
            s.process_batch_result(batch, s.run_batch(batch))
        else:
            s.self_check_during_idle()
        s.state.last_batch = batch
        s.output.flush()

    def close(self) -> None:
        return None


class OverlapLoop:
    """event_loop_overlap (seed 001 §2.2): batch N's results are processed after batch N+1 has been
    launched (on the forward thread on CPU, the forward stream on CUDA: scheduler/overlap.py), so
    result processing hides behind the next forward."""

    def __init__(self, scheduler: Scheduler) -> None:
        if scheduler.builder.spec_step is not None:
            # ServerArgs.resolve() refuses the combination; a hand-built ServerArgs must not slip by.
            raise ValueError("speculative decoding runs in the normal loop only (disable_overlap_schedule)")
        self.scheduler = scheduler
        self.future_map = FutureMap(
            scheduler.max_running_requests,
            scheduler.chunked_prefill_size,
            scheduler.worker.max_context_len,
            scheduler.device,
        )
        self.worker = create_overlap_executor(scheduler.worker, self.future_map, scheduler.device)
        self.result_queue: deque[tuple[ScheduleBatch, PendingResult]] = deque()

    def _pop_and_process(self) -> None:
        batch, future = self.result_queue.popleft()
        self.scheduler.process_batch_result(batch, future.result())

    def _launch(self, batch: ScheduleBatch) -> None:
        s = self.scheduler
        mwb = s.get_model_worker_batch(batch)
        future_indices = self.future_map.alloc_future_indices(batch.batch_size())
        s._mark_launched(batch, future_indices)
        s.control.before_forward()
        self.result_queue.append((batch.copy(), self.worker.launch(mwb, future_indices)))

    def step(self, recv_reqs: Iterable[object] = ()) -> None:
        s = self.scheduler
        s.process_input_requests(recv_reqs)
        # Penalty counts are updated in place when results are processed; a batch that carries them
        # is processed before the next batch is built so rows still line up (no overlap for it).
        # Grammar masks likewise need the previous token accepted by each matcher first.
        if self.result_queue and _needs_sync(self.result_queue[-1][0]):
            self._pop_and_process()
        batch = s.get_next_batch_to_run()
        disable_overlap = s.is_disable_overlap_for_batch(batch)
        if disable_overlap and self.result_queue:
            self._pop_and_process()
        if batch is not None:
            self._launch(batch)
        # Process the previous batch while the current one runs on the forward thread / stream.
        if len(self.result_queue) > (1 if batch is not None else 0):
            self._pop_and_process()
        elif batch is None and s.state.last_batch is None:
            s.self_check_during_idle()
        s.state.last_batch = batch
        s.output.flush()

    def close(self) -> None:
        while self.result_queue:
            self._pop_and_process()
        self.worker.shutdown()


def _needs_sync(batch: ScheduleBatch) -> bool:
    """Whether `batch`'s results must be processed before the next batch is built."""
    if batch.sampling_info is not None and batch.sampling_info.penalizer is not None:
        return True
    return any(r.grammar is not None for r in batch.reqs)
