"""event_loop_pp as an executor of the one Loop: a pipeline stage (INVENTORY §34).

Every stage runs the same scheduler over the same inputs. The batch is split into pp_size
micro-batches, each with its own running batch (at most --pp-max-micro-batch-size requests), so
that while the last stage computes micro-batch k, the first stage already computes k + 1:

    iteration k, slot j = k % pp_size, on every stage:
      1. receive this iteration's inputs (stage 0: the TokenizerManager via rank 0 and the TP
         broadcast; later stages: from the same TP index of the previous stage) and pass them on
         (`inputs`, the loop's receive function)
      2. process slot j's result from iteration k - pp_size (the last stage keeps its own; the
         others receive it from the last stage), and make slot j's running batch the
         scheduler's (`before_schedule`)
      3. build slot j's next batch and run this stage's layers on it (hidden states arrive from
         the previous stage and leave for the next one); the last stage samples and sends the
         result to every earlier stage (`launch`); keep slot j's state (`collect`)

All stages thus see inputs and results at the same logical point and make the same decisions.
A stage never waits on a later stage except for a result it needs pp_size iterations later.

A request whose prompt is chunked may have its chunks in different slots; it joins the running
batch of the slot that ran its last chunk, and is dropped from the earlier slots' batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.distributed.pipeline import StageLink
from radixserve.model_executor.forward_batch import GenerationBatchResult
from radixserve.scheduler.loops import Finish, SyncExecutor
from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler


@dataclass
class MicroBatchSlot:
    running_batch: ScheduleBatch
    last_batch: ScheduleBatch | None = None
    inflight: ScheduleBatch | None = None  # launched, its result not processed yet
    local_result: GenerationBatchResult | None = None  # the last stage's own result of `inflight`
    mid_chunk_req: Req | None = None  # a request `last_batch` ran a middle chunk of


class PipelineExecutor(SyncExecutor):
    """pp_size micro-batch slots, each with its own running batch, taken in turn. The builder's
    running cap is the micro-batch size (LiveLimits.batch_cap)."""

    def __init__(self, core: Scheduler, link: StageLink) -> None:
        super().__init__(core)
        self.link = link
        self.is_last = link.next is None
        self.pp_size = len(link.earlier) + 1
        self.slots = [MicroBatchSlot(core.make_batch([])) for _ in range(self.pp_size)]
        self.iteration = 0
        self.slot = self.slots[0]

    def inputs(self, recv_stage0: Callable[[], list[object]]) -> Callable[[], list[object]]:
        """Stage 0 reads its own inputs, later stages get them from the previous stage; every
        stage but the last passes them on."""
        link = self.link

        def recv() -> list[object]:
            msgs = recv_stage0() if link.prev is None else link.recv_from_prev()
            if link.next is not None:
                link.send_to_next(msgs)
            return msgs

        return recv

    def before_schedule(self, finish: Finish) -> None:
        slot = self.slot = self.slots[self.iteration % self.pp_size]
        if slot.inflight is not None:
            batch, slot.inflight = slot.inflight, None
            finish(batch, self._result_of(slot))
        self._swap_in(slot)

    def _result_of(self, slot: MicroBatchSlot) -> GenerationBatchResult:
        if self.is_last:
            result, slot.local_result = slot.local_result, None
            assert result is not None
            return result
        return self.link.recv_result()

    def _swap_in(self, slot: MicroBatchSlot) -> None:
        state = self.core.state
        if slot.last_batch is not None and slot.mid_chunk_req is not None:
            slot.last_batch.filter_batch(chunked_req_to_exclude=[slot.mid_chunk_req])
        state.running_batch, state.last_batch = slot.running_batch, slot.last_batch
        # Requests decoding in the other micro-batches keep their share of the KV reserved.
        state.other_running_reqs = [
            r for other in self.slots if other is not slot for r in other.running_batch.reqs
        ]

    def launch(self, batch: ScheduleBatch, finish: Finish) -> None:
        result = self.core.run_batch(batch)  # this stage's layers; hidden states move on
        self.slot.inflight = batch
        if self.is_last:
            assert isinstance(result, GenerationBatchResult)
            self.slot.local_result = self.link.publish_result(result)

    def collect(self, batch: ScheduleBatch | None, finish: Finish) -> bool:
        slot, state = self.slot, self.core.state
        slot.running_batch, slot.last_batch = state.running_batch, batch
        # A middle chunk: its request must not join this slot's running batch later.
        slot.mid_chunk_req = state.chunked_req if batch is not None else None
        self.iteration += 1
        return batch is None and all(sl.inflight is None for sl in self.slots)

    def close(self, finish: Finish) -> None:
        self.link.close()
