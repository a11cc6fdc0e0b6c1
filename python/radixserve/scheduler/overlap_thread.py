"""The CPU overlap executor: forwards run on one background thread, in launch order (which is
what makes KV written by batch N safe for batch N+1 to read, and the FutureMap filled before
batch N+1 resolves its references)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.scheduler.overlap import ForwardWorker, FutureMap


class ThreadOverlapExecutor:
    def __init__(self, worker: ForwardWorker, future_map: FutureMap) -> None:
        self.worker = worker
        self.future_map = future_map
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-forward")

    def launch(
        self, mwb: ModelWorkerBatch, future_indices: list[int]
    ) -> Future[GenerationBatchResult | EmbeddingBatchResult]:
        return self._executor.submit(self._run, mwb, future_indices)

    def _run(
        self, mwb: ModelWorkerBatch, future_indices: list[int]
    ) -> GenerationBatchResult | EmbeddingBatchResult:
        self.future_map.resolve_future(mwb)
        if mwb.is_embedding:  # prefill-only: no token for a later batch to read
            return self.worker.forward_batch_embedding(mwb)
        result = self.worker.forward_batch_generation(mwb)
        self.future_map.store_to_map(future_indices, result.next_token_ids)
        return result

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
