"""A model worker that does no math: real pools, constant next tokens.

It isolates the scheduler's own CPU cost per step (batch building, pool bookkeeping, result
processing, output messages) from the forward pass.
"""

from __future__ import annotations

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.worker_api import KVPools, WorkerInfo


class NullWorker:
    def __init__(
        self,
        max_total_num_tokens: int,
        max_req_num: int,
        max_context_len: int,
        vocab_size: int,
        page_size: int = 1,
    ) -> None:
        rows = ReqToTokenPool(max_req_num + 1, max_context_len, "cpu")
        slots = TokenToKVPoolAllocator(max_total_num_tokens, page_size)
        self.pools = KVPools(rows, slots, max_total_num_tokens, max_req_num, max_context_len)
        self.info = WorkerInfo(vocab_size)
        self.token = vocab_size - 1

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        return GenerationBatchResult(
            next_token_ids=torch.full((mwb.batch_size,), self.token, dtype=torch.int64)
        )
