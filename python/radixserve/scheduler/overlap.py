"""Overlap machinery (seed 001 §3, seed 004): the forward of batch N+1 runs while the scheduler
processes batch N's results.

On CPU the forward runs on one worker thread (forwards stay in launch order, which is what makes KV
written by batch N safe for batch N+1 to read). Tokens of a launched batch are not known when the
next batch is built, so the next batch refers to them as `-future_idx` in its input_ids; the
worker thread replaces those references from the FutureMap right before the forward, after batch
N's forward has stored its tokens there.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch


class ForwardWorker(Protocol):
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult: ...


class FutureMap:
    """A circular buffer of token ids indexed by future index (>= 1, so -index is negative).

    Sizing follows seed 001: a running decode batch, then up to one prefill chunk per chunk of the
    context, each at most max_running_requests wide, must fit before the buffer wraps.
    """

    def __init__(self, max_running_requests: int, chunked_prefill_size: int | None, context_len: int) -> None:
        max_num_chunks = -(-context_len // chunked_prefill_size) if chunked_prefill_size else 0
        self.future_limit = max_running_requests * (3 + max_num_chunks)
        # Slack so an allocation starting just below future_limit never wraps mid-batch.
        self.future_buffer_len = self.future_limit + 2 * max_running_requests
        self.token_ids_buf = torch.zeros(self.future_buffer_len + 1, dtype=torch.int64)  # [len + 1]
        self.future_ct = 0

    def alloc_future_indices(self, bs: int) -> list[int]:
        start = self.future_ct + 1
        self.future_ct = (self.future_ct + bs) % self.future_limit
        return list(range(start, start + bs))

    def resolve_future(self, mwb: ModelWorkerBatch) -> None:
        """Replace negative input ids (future references) by the tokens stored for them."""
        ids = mwb.input_ids  # [num_tokens] int64
        if ids.numel() and bool((ids < 0).any()):
            mwb.input_ids = torch.where(ids < 0, self.token_ids_buf[(-ids).clamp(min=0)], ids)

    def store_to_map(self, future_indices: list[int], next_token_ids: torch.Tensor) -> None:
        if future_indices:
            idx = torch.tensor(future_indices, dtype=torch.int64)  # [bs]
            self.token_ids_buf[idx] = next_token_ids.to("cpu", torch.int64)


class OverlapWorker:
    """Runs any worker's forward_batch_generation on one background thread; launch() returns at
    once with a Future of the result."""

    def __init__(self, worker: ForwardWorker, future_map: FutureMap) -> None:
        self.worker = worker
        self.future_map = future_map
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-forward")

    def launch(self, mwb: ModelWorkerBatch, future_indices: list[int]) -> Future[GenerationBatchResult]:
        return self._executor.submit(self._run, mwb, future_indices)

    def _run(self, mwb: ModelWorkerBatch, future_indices: list[int]) -> GenerationBatchResult:
        self.future_map.resolve_future(mwb)
        result = self.worker.forward_batch_generation(mwb)
        self.future_map.store_to_map(future_indices, result.next_token_ids)
        return result

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
