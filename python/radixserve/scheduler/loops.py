"""The scheduler's one event loop, `Loop(core, executor, hooks).step()` (seed 001 §2), and the
executors that decide when a launched batch runs and when its result is processed. The step, the
executors and the hooks are drawn in docs/architecture.md ("The scheduler's loop");
scheduler/build.py picks them, nothing here looks at a flag.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from radixserve.managers.io_struct import BATCH_PRIORITY, EmbeddingBatchResult, TokenizedGenerateReqInput
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.scheduler.overlap import FutureMap, PendingResult, create_overlap_executor
from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

BatchResult = GenerationBatchResult | EmbeddingBatchResult
Finish = Callable[[ScheduleBatch, BatchResult], None]

# When a step ran nothing but a hook has transfers pending, the loop sleeps this long, not spin.
PENDING_POLL_S = 0.001


class LoopHooks:
    """What a feature adds around the core's step (PD's queues: disaggregation/). The base adds
    nothing: a colocated server runs with it."""

    def admit(self, msg: TokenizedGenerateReqInput, req: Req) -> bool:
        """Take a generate request the core accepted into this feature's own queues; True when
        taken (False: the core's waiting queue gets it)."""
        return False

    def before_schedule(self) -> bool:
        """Move what became ready into the scheduler's queues; True: that was work (not idle)."""
        return False

    def on_result(self, batch: ScheduleBatch, result: BatchResult) -> bool:
        """Take a batch's result instead of the OutputProcessor; True when taken."""
        return False

    def after_step(self) -> None:
        """Runs after the step's batch became state.last_batch, before the outputs are sent."""

    def has_pending(self) -> bool:
        """Work waits outside the scheduler (a KV transfer): an idle step sleeps, no self-check."""
        return False

    def internal_state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class SyncExecutor:
    """How a launched batch runs and when its result is processed. This base runs it now
    (event_loop_normal, seed 001 §2.1: the CPU waits for each forward, then processes it);
    OverlapScheduleExecutor and PipelineExecutor change when."""

    def __init__(self, core: Scheduler) -> None:
        self.core = core

    def inputs(self, recv: Callable[[], list[object]]) -> Callable[[], list[object]]:
        """The loop's receive function, given the process's."""
        return recv

    def before_schedule(self, finish: Finish) -> None:
        return None

    def launch(self, batch: ScheduleBatch, finish: Finish) -> None:
        finish(batch, self.core.run_batch(batch))

    def collect(self, batch: ScheduleBatch | None, finish: Finish) -> bool:
        """Process the results whose turn it is; True when the step was quiet (no batch, none in
        flight, nothing processed), so the idle self-check may run."""
        return batch is None

    def close(self, finish: Finish) -> None:
        return None


class Loop:
    def __init__(self, core: Scheduler, executor: SyncExecutor, hooks: LoopHooks | None = None) -> None:
        self.core = core
        self.executor = executor
        self.hooks = hooks or LoopHooks()

    def step(self, recv_reqs: Iterable[object] = ()) -> None:
        core, executor, hooks = self.core, self.executor, self.hooks
        core.process_input_requests(recv_reqs)
        executor.before_schedule(self.finish)
        did_work = hooks.before_schedule()
        batch = core.get_next_batch_to_run()
        if batch is not None:
            executor.launch(batch, self.finish)
        quiet = executor.collect(batch, self.finish)
        core.state.last_batch = batch
        hooks.after_step()
        core.output.flush()
        if quiet and not did_work:
            if hooks.has_pending():
                time.sleep(PENDING_POLL_S)
            else:
                core.self_check_during_idle()

    def finish(self, batch: ScheduleBatch, result: BatchResult) -> None:
        if self.hooks.on_result(batch, result):
            self.core.note_batch_done()
        else:
            self.core.process_batch_result(batch, result)

    def run_forever(self, recv_requests: Callable[[], list[object]]) -> None:
        """The scheduler process's `while True` (never returns)."""
        recv_requests = self.executor.inputs(recv_requests)
        try:
            while True:
                self.step(recv_requests())
        finally:
            self.close()

    def close(self) -> None:
        self.executor.close(self.finish)
        self.hooks.close()


class OverlapScheduleExecutor(SyncExecutor):
    """event_loop_overlap (seed 001 §2.2): batch N's results are processed after batch N+1 has
    been launched (on the forward thread on CPU, the forward stream on CUDA: scheduler/overlap.py),
    so result processing hides behind the next forward. A batch with grammars or penalties keeps
    that overlap: only its sample waits for batch N's results (delayed sampling). A batch of only
    batch-class requests (idle capacity) is processed in its own step, so nothing runs ahead of
    the request that arrives while it runs (docs/benchmarks.md, "Batch API")."""

    def __init__(self, core: Scheduler) -> None:
        if core.builder.spec_step is not None:
            # ServerArgs.resolve() refuses the combination; a hand-built ServerArgs must not slip by.
            raise ValueError("speculative decoding runs in the normal loop only (disable_overlap_schedule)")
        super().__init__(core)
        # The request rows bound every batch's width, whatever the live running cap becomes.
        pools = core.worker.pools
        self.future_map = FutureMap(
            pools.max_req_num, core.chunked_prefill_size, pools.max_context_len, core.device
        )
        self.worker = create_overlap_executor(core.worker, self.future_map, core.device)
        self.result_queue: deque[tuple[ScheduleBatch, PendingResult]] = deque()
        # The batch launched this step with a delayed sample: (its requests, its mwb, its handle).
        self.delayed_sample: tuple[list[Req], ModelWorkerBatch, PendingResult] | None = None

    def _pop_and_process(self, finish: Finish) -> None:
        batch, future = self.result_queue.popleft()
        finish(batch, future.result())

    def launch(self, batch: ScheduleBatch, finish: Finish) -> None:
        if self.result_queue and self.core.is_disable_overlap_for_batch(batch):
            self._pop_and_process(finish)
        delay = needs_delayed_sample(batch)
        future_indices = self.future_map.alloc_future_indices(batch.batch_size())
        mwb = self.core.launch(batch, future_indices, delay_sample=delay)
        pending = self.worker.launch(mwb, future_indices)
        self.result_queue.append((batch.copy(), pending))
        if delay:
            self.delayed_sample = (list(batch.reqs), mwb, pending)

    def collect(self, batch: ScheduleBatch | None, finish: Finish) -> bool:
        quiet = False
        # Process the previous batch while the current one runs on the forward thread / stream.
        if len(self.result_queue) > (1 if batch is not None else 0):
            self._pop_and_process(finish)
        else:
            quiet = batch is None and self.core.state.last_batch is None
        # Every earlier batch is processed now: the current one may sample.
        self.launch_batch_sample_if_needed()
        if batch is not None and self.result_queue and only_batch_class(batch):
            # Idle capacity runs one step at a time: were it launched ahead, an interactive request
            # received next step would wait for this whole batch too, not just the rest of it.
            self._pop_and_process(finish)
        return quiet

    def launch_batch_sample_if_needed(self) -> None:
        """Seed 001 §2.2: the batch launched this step samples only now, after the previous
        batch's results updated its requests' grammar matchers and output_ids."""
        if self.delayed_sample is None:
            return
        reqs, mwb, pending = self.delayed_sample
        self.delayed_sample = None
        self.core.prepare_sample(reqs, mwb)
        self.worker.launch_sample(pending)

    def close(self, finish: Finish) -> None:
        while self.result_queue:
            self._pop_and_process(finish)
        self.worker.shutdown()


def only_batch_class(batch: ScheduleBatch) -> bool:
    """Every request of `batch` is batch-class (BATCH_PRIORITY or below: OpenAI batch lines)."""
    return bool(batch.reqs) and all(r.priority <= BATCH_PRIORITY for r in batch.reqs)


def needs_delayed_sample(batch: ScheduleBatch) -> bool:
    """Whether sampling `batch` depends on the previous batch's tokens: a grammar mask (the
    matcher must accept the previous token first) or penalty / min_new_tokens counts."""
    if batch.sampling_info is not None and batch.sampling_info.penalizer is not None:
        return True
    return any(r.grammar is not None for r in batch.reqs)
