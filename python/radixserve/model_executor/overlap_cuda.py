"""The CUDA overlap executor (seed 001 §3.1-3.2, seed 000 §12, seed 004).

The scheduler's thread enqueues each forward on a dedicated forward stream and returns at once;
the GPU runs the forwards back to back while the CPU builds the next batch and processes the
previous one. Per launch, on the forward stream:

1. wait for the schedule (default) stream, which wrote this batch's req_to_token entries;
2. resolve the batch's future references from the device FutureMap (stream order guarantees the
   producing forward already stored them);
3. forward + sample (a delayed sample: forward only; steps 4-5 follow the sample, enqueued by
   `launch_sample` once the scheduler set the batch's grammar mask / penalty counts);
4. store the sampled tokens into the FutureMap at this batch's future indices;
5. copy the tokens (and logprobs) to pinned host memory without blocking and record `copy_done`.

Result processing calls `copy_done.synchronize()` before it reads the tokens (seed 001 §5.1):
the only point where the CPU waits for the GPU, one batch behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch

if TYPE_CHECKING:
    from radixserve.scheduler.overlap import ForwardWorker, FutureMap


@dataclass
class LaunchedBatch:
    """A forward already enqueued: its result's host tensors are valid once copy_done fires (for a
    delayed sample, once launch_sample has enqueued the sample too)."""

    batch_result: GenerationBatchResult | EmbeddingBatchResult
    future_indices: list[int] | None = None

    def result(self) -> GenerationBatchResult | EmbeddingBatchResult:
        pending = getattr(self.batch_result, "delay_sample_func", None)
        assert pending is None, "launch_sample was not called for this batch"
        return self.batch_result


def copy_to_cpu(result: GenerationBatchResult) -> None:
    """Start device-to-host copies of the per-row outputs (non_blocking lands in pinned memory, so
    the copy is truly asynchronous); the caller records copy_done after them."""
    result.next_token_ids = result.next_token_ids.to("cpu", non_blocking=True)
    if result.next_token_logprobs is not None:
        result.next_token_logprobs = result.next_token_logprobs.to("cpu", non_blocking=True)
    if result.invalid_rows is not None:
        result.invalid_rows = result.invalid_rows.to("cpu", non_blocking=True)


class CudaStreamOverlapExecutor:
    def __init__(self, worker: ForwardWorker, future_map: FutureMap, device: torch.device) -> None:
        self.worker = worker
        self.future_map = future_map
        self.device = device
        self.schedule_stream = torch.cuda.current_stream(device)
        self.forward_stream = torch.cuda.Stream(device)
        # Device tensors the schedule stream allocated for a launched batch (sampling parameters,
        # penalty state) must outlive its forward: freed early, the caching allocator could hand
        # their memory to the schedule stream while the forward stream still reads them. Two
        # batches suffice: when a third is launched, the oldest one's copy_done has been waited on.
        self.batch_record_buf: list[ModelWorkerBatch | None] = [None, None]
        self.batch_record_ct = 0

    def _record_batch(self, mwb: ModelWorkerBatch) -> None:
        self.batch_record_buf[self.batch_record_ct] = mwb
        self.batch_record_ct = (self.batch_record_ct + 1) % len(self.batch_record_buf)

    def launch(self, mwb: ModelWorkerBatch, future_indices: list[int]) -> LaunchedBatch:
        self._record_batch(mwb)
        with torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_stream(self.schedule_stream)
            self.future_map.resolve_future(mwb)
            if mwb.is_embedding:  # prefill-only: its vectors are already host lists, no token
                return LaunchedBatch(self.worker.forward_batch_embedding(mwb))
            result = self.worker.forward_batch_generation(mwb)
            if result.delay_sample_func is None:
                self._finish(result, future_indices)
        return LaunchedBatch(result, future_indices)

    def launch_sample(self, pending: LaunchedBatch) -> None:
        """Enqueue a delayed sample behind its forward; the scheduler set the batch's grammar mask
        and penalty counts on the schedule stream (and host) just before."""
        result = pending.batch_result
        assert result.delay_sample_func is not None and pending.future_indices is not None
        with torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_stream(self.schedule_stream)
            result.delay_sample_func()
            result.delay_sample_func = None
            self._finish(result, pending.future_indices)

    def _finish(self, result: GenerationBatchResult, future_indices: list[int]) -> None:
        """On the forward stream: publish the sampled tokens to the FutureMap and the host."""
        self.future_map.store_to_map(future_indices, result.next_token_ids)
        copy_to_cpu(result)
        copy_done = torch.cuda.Event()
        copy_done.record(self.forward_stream)
        result.copy_done = copy_done

    def shutdown(self) -> None:
        self.forward_stream.synchronize()
