"""The scheduler's event loops: NormalLoop (seed 001 §2.1) and OverlapLoop (§2.2).

Each `step(recv_reqs)` dispatches the received requests, builds and runs at most one batch and
processes results; Scheduler.event_loop runs one of them forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.scheduler.overlap import FutureMap, PendingResult, create_overlap_executor
from radixserve.scheduler.req import Req
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
    result processing hides behind the next forward. A batch with grammars or penalties keeps that
    overlap: only its sample waits for batch N's results (delayed sampling)."""

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
        # The batch launched this step with a delayed sample: (its requests, its mwb, its handle).
        self.delayed_sample: tuple[list[Req], ModelWorkerBatch, PendingResult] | None = None

    def _pop_and_process(self) -> None:
        batch, future = self.result_queue.popleft()
        self.scheduler.process_batch_result(batch, future.result())

    def _launch(self, batch: ScheduleBatch) -> None:
        s = self.scheduler
        delay = needs_delayed_sample(batch)
        mwb = s.get_model_worker_batch(batch, delay_sample=delay)
        future_indices = self.future_map.alloc_future_indices(batch.batch_size())
        s._mark_launched(batch, future_indices)
        s.operators.before_forward()
        pending = self.worker.launch(mwb, future_indices)
        self.result_queue.append((batch.copy(), pending))
        if delay:
            self.delayed_sample = (list(batch.reqs), mwb, pending)

    def launch_batch_sample_if_needed(self) -> None:
        """Seed 001 §2.2: the batch launched this step samples only now, after the previous
        batch's results updated its requests' grammar matchers and output_ids."""
        if self.delayed_sample is None:
            return
        reqs, mwb, pending = self.delayed_sample
        self.delayed_sample = None
        self.scheduler.prepare_sample(reqs, mwb)
        self.worker.launch_sample(pending)

    def step(self, recv_reqs: Iterable[object] = ()) -> None:
        s = self.scheduler
        s.process_input_requests(recv_reqs)
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
        # Every earlier batch is processed now: the current one may sample.
        self.launch_batch_sample_if_needed()
        s.state.last_batch = batch
        s.output.flush()

    def close(self) -> None:
        while self.result_queue:
            self._pop_and_process()
        self.worker.shutdown()


def needs_delayed_sample(batch: ScheduleBatch) -> bool:
    """Whether sampling `batch` depends on the previous batch's tokens: a grammar mask (the
    matcher must accept the previous token first) or penalty / min_new_tokens counts."""
    if batch.sampling_info is not None and batch.sampling_info.penalizer is not None:
        return True
    return any(r.grammar is not None for r in batch.reqs)
