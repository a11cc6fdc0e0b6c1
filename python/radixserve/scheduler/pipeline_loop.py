"""event_loop_pp: the scheduler loop of a pipeline stage (INVENTORY §34).

Every stage runs the same scheduler over the same inputs. The batch is split into pp_size
micro-batches, each with its own running batch (at most --pp-max-micro-batch-size requests), so
that while the last stage computes micro-batch k, the first stage already computes k + 1:

    iteration k, slot j = k % pp_size, on every stage:
      1. receive this iteration's inputs (stage 0: the TokenizerManager via rank 0 and the TP
         broadcast; later stages: from the same TP index of the previous stage) and pass them on
      2. process slot j's result from iteration k - pp_size (the last stage keeps its own; the
         others receive it from the last stage)
      3. build slot j's next batch and run this stage's layers on it (hidden states arrive from
         the previous stage and leave for the next one); the last stage samples and sends the
         result to every earlier stage

All stages thus see inputs and results at the same logical point and make the same decisions.
A stage never waits on a later stage except for a result it needs pp_size iterations later.

A request whose prompt is chunked may have its chunks in different slots; it joins the running
batch of the slot that ran its last chunk, and is dropped from the earlier slots' batches.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.distributed.pipeline import StageLink
from radixserve.model_executor.forward_batch import GenerationBatchResult
from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class MicroBatchSlot:
    running_batch: ScheduleBatch
    last_batch: ScheduleBatch | None = None
    inflight: ScheduleBatch | None = None  # launched, its result not processed yet
    local_result: GenerationBatchResult | None = None  # the last stage's own result of `inflight`
    mid_chunk_req: Req | None = None  # a request `last_batch` ran a middle chunk of


class PipelineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        link: StageLink,
        recv_stage0_inputs: Callable[[], list[object]],  # used by the first stage only
        micro_batch_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.link = link
        self.recv_stage0_inputs = recv_stage0_inputs
        self.is_first = link.prev is None
        self.is_last = link.next is None
        self.pp_size = len(link.earlier) + 1
        builder = scheduler.builder
        # Each micro-batch's running cap: the builder's own copy of the live limits (the knob is
        # fixed under PP, LiveLimits.running_cap_fixed), while the reported total stays as set.
        builder.live = dataclasses.replace(builder.live, max_running_requests=micro_batch_size)
        self.slots = [MicroBatchSlot(scheduler.make_batch([])) for _ in range(self.pp_size)]
        self.iteration = 0
        logger.info(
            "Pipeline stage %d of %d: %d micro-batches of at most %d requests",
            link.groups.pp_rank,
            self.pp_size,
            self.pp_size,
            micro_batch_size,
        )

    # ------------------------------------------------------------------ one iteration
    def step(self) -> None:
        s = self.scheduler
        slot = self.slots[self.iteration % self.pp_size]
        s.process_input_requests(self._recv_inputs())
        if slot.inflight is not None:
            batch, slot.inflight = slot.inflight, None
            s.process_batch_result(batch, self._result_of(slot))
        self._swap_in(slot)
        batch = s.get_next_batch_to_run()
        if batch is not None:
            self._launch(slot, batch)
        elif all(sl.inflight is None for sl in self.slots):
            s.self_check_during_idle()
        slot.running_batch, slot.last_batch = s.state.running_batch, batch
        # A middle chunk: its request must not join this slot's running batch later.
        slot.mid_chunk_req = s.state.chunked_req if batch is not None else None
        s.output.flush()
        self.iteration += 1

    def _recv_inputs(self) -> list[object]:
        msgs = self.recv_stage0_inputs() if self.is_first else self.link.recv_from_prev()
        if not self.is_last:
            self.link.send_to_next(msgs)
        return msgs

    def _result_of(self, slot: MicroBatchSlot) -> GenerationBatchResult:
        if self.is_last:
            result, slot.local_result = slot.local_result, None
            assert result is not None
            return result
        return self.link.recv_result()

    def _swap_in(self, slot: MicroBatchSlot) -> None:
        state = self.scheduler.state
        if slot.last_batch is not None and slot.mid_chunk_req is not None:
            slot.last_batch.filter_batch(chunked_req_to_exclude=[slot.mid_chunk_req])
        state.running_batch, state.last_batch = slot.running_batch, slot.last_batch
        # Requests decoding in the other micro-batches keep their share of the KV reserved.
        state.other_running_reqs = [
            r for other in self.slots if other is not slot for r in other.running_batch.reqs
        ]

    def _launch(self, slot: MicroBatchSlot, batch: ScheduleBatch) -> None:
        s = self.scheduler
        mwb = s.get_model_worker_batch(batch)
        s._mark_launched(batch, None)
        s.operators.before_forward()
        with torch.inference_mode():
            result = s.worker.forward_batch_generation(mwb)
        slot.inflight = batch
        if self.is_last:
            assert result is not None
            slot.local_result = self.link.publish_result(result)

    def close(self) -> None:
        self.link.close()

    def run_forever(self) -> None:
        try:
            while True:
                self.step()
        finally:
            self.close()
