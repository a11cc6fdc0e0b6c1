"""Overlap machinery (seed 001 §3, seed 004): the forward of batch N+1 is launched before the
scheduler processes batch N's results, so result processing hides behind the next forward.

Tokens of a launched batch are not known when the next batch is built, so the next batch refers to
them as `-future_idx` in its input_ids. Right before its forward, in forward order, the references
are replaced from the FutureMap, where batch N's forward stored its sampled tokens.

How a forward is launched depends on the device (`create_overlap_executor`):
- CPU (scheduler/overlap_thread.py): one worker thread runs the forwards in launch order.
- CUDA (model_executor/overlap_cuda.py): the forward is enqueued on a dedicated forward stream from
  the scheduler's own thread; the FutureMap lives on the device and tokens reach the host through a
  non-blocking copy guarded by a copy-done event. No host synchronisation inside a step.
Both return a handle whose `result()` gives the GenerationBatchResult; when its `copy_done` is set,
result processing waits on that event before it reads the tokens.

Delayed sampling (seed 001 §2.2, `launch_batch_sample_if_needed`): a batch whose sampling depends on
the previous batch's tokens (a grammar mask, penalty counts) is launched with delay_sample_launch:
its forward overlaps with the processing of the previous batch's results as any other, and only
its sample is launched afterwards (`launch_sample`), once that state is up to date.
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch


class ForwardWorker(Protocol):
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult: ...

    def forward_batch_embedding(self, mwb: ModelWorkerBatch) -> EmbeddingBatchResult: ...


class PendingResult(Protocol):
    def result(self) -> GenerationBatchResult | EmbeddingBatchResult: ...


class OverlapExecutor(Protocol):
    """Launches forwards ahead of result processing, in order."""

    def launch(self, mwb: ModelWorkerBatch, future_indices: list[int]) -> PendingResult:
        """Start the forward of `mwb` (its negative input ids resolved first) and store its tokens
        at `future_indices`; returns without waiting for the forward. With
        mwb.delay_sample_launch only the forward starts: the handle's result() is valid once
        launch_sample(handle) has been called too."""
        ...

    def launch_sample(self, pending: PendingResult) -> None:
        """Start the delayed sample of a launched batch (after every forward launched before it),
        then store its tokens at the batch's future indices; returns without waiting."""
        ...

    def shutdown(self) -> None:
        """Wait for launched forwards and release threads/streams."""
        ...


class FutureMap:
    """A circular buffer of token ids indexed by future index (>= 1, so -index is negative), on the
    model's device.

    Sizing is SGLang's rule (v0.5 `FutureMap`): with W the widest batch, future_limit =
    W * (3 + max_num_chunks) and the buffer is W * (5 + max_num_chunks) long: a running decode
    batch, then up to one prefill chunk per chunk of the context must fit before the ring wraps, and
    the slack of 2 * W past future_limit means one batch's indices never wrap, so they are a
    contiguous range and storing them is a slice assignment (no index tensor to copy to the device).
    W is the request rows (max_req_num), as SGLang's newest FutureMap is indexed by req_pool_idx over
    the whole req_to_token pool: SGLang's W, max_running_requests, is fixed at start, while here
    /set_internal_state may raise the running cap up to max_req_num while serving.
    """

    def __init__(
        self,
        max_req_num: int,
        chunked_prefill_size: int | None,
        context_len: int,
        device: str | torch.device = "cpu",
    ) -> None:
        max_num_chunks = -(-context_len // chunked_prefill_size) if chunked_prefill_size else 0
        self.future_limit = max_req_num * (3 + max_num_chunks)
        self.future_buffer_len = self.future_limit + 2 * max_req_num
        self.device = torch.device(device)
        # [len + 1]: index 0 is never handed out; resolve_future reads it for non-future ids.
        self.token_ids_buf = torch.zeros(self.future_buffer_len + 1, dtype=torch.int64, device=self.device)
        self.future_ct = 0

    def alloc_future_indices(self, bs: int) -> list[int]:
        start = self.future_ct + 1
        self.future_ct = (self.future_ct + bs) % self.future_limit
        return list(range(start, start + bs))

    def resolve_future(self, mwb: ModelWorkerBatch) -> None:
        """Replace negative input ids (future references) by the tokens stored for them. Must run in
        forward order (on the forward thread / stream), after the producing forward stored them."""
        ids = mwb.input_ids  # [num_tokens] int64, on the host as the scheduler built it
        # The test reads host memory, so it never waits for the device.
        if ids.numel() and bool((ids < 0).any()):
            ids = ids.to(self.device, non_blocking=True)
            mwb.input_ids = torch.where(ids < 0, self.token_ids_buf[(-ids).clamp(min=0)], ids)

    def store_to_map(self, future_indices: list[int], next_token_ids: torch.Tensor) -> None:
        """token_ids_buf[future_indices] = next_token_ids ([bs] int64, on any device)."""
        if future_indices:
            start = future_indices[0]
            assert future_indices[-1] == start + len(future_indices) - 1, "future indices are contiguous"
            # Same device: an asynchronous copy in stream order. Across devices copy_ blocks.
            self.token_ids_buf[start : start + len(future_indices)].copy_(next_token_ids)


def create_overlap_executor(
    worker: ForwardWorker, future_map: FutureMap, device: str | torch.device
) -> OverlapExecutor:
    """CUDA streams on a CUDA device, a worker thread elsewhere."""
    if torch.device(device).type == "cuda":
        # Imported only here: streams and events stay in model_executor/ (house style).
        from radixserve.model_executor.overlap_cuda import CudaStreamOverlapExecutor

        return CudaStreamOverlapExecutor(worker, future_map, torch.device(device))
    from radixserve.scheduler.overlap_thread import ThreadOverlapExecutor

    return ThreadOverlapExecutor(worker, future_map)
