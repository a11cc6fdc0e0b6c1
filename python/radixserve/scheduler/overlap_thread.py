"""The CPU overlap executor: forwards (and delayed samples) run on one background thread, in
launch order (which is what makes KV written by batch N safe for batch N+1 to read, and the
FutureMap filled before batch N+1 resolves its references)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.scheduler.overlap import ForwardWorker, FutureMap


class DelayedSample:
    """A batch launched with delay_sample_launch: its forward's future, then its sample's."""

    def __init__(self, forward: Future[GenerationBatchResult], future_indices: list[int]) -> None:
        self.forward = forward
        self.future_indices = future_indices
        self.sample: Future[GenerationBatchResult] | None = None

    def result(self) -> GenerationBatchResult:
        assert self.sample is not None, "launch_sample was not called for this batch"
        return self.sample.result()


class ThreadOverlapExecutor:
    def __init__(self, worker: ForwardWorker, future_map: FutureMap) -> None:
        self.worker = worker
        self.future_map = future_map
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-forward")

    def launch(
        self, mwb: ModelWorkerBatch, future_indices: list[int]
    ) -> Future[GenerationBatchResult | EmbeddingBatchResult] | DelayedSample:
        forward = self._executor.submit(self._run, mwb, future_indices)
        return DelayedSample(forward, future_indices) if mwb.delay_sample_launch else forward

    def _run(
        self, mwb: ModelWorkerBatch, future_indices: list[int]
    ) -> GenerationBatchResult | EmbeddingBatchResult:
        self.future_map.resolve_future(mwb)
        if mwb.is_embedding:  # prefill-only: no token for a later batch to read
            return self.worker.forward_batch_embedding(mwb)
        result = self.worker.forward_batch_generation(mwb)
        if result.delay_sample_func is None:
            self.future_map.store_to_map(future_indices, result.next_token_ids)
        return result

    def launch_sample(self, pending: DelayedSample) -> None:
        pending.sample = self._executor.submit(self._sample, pending)

    def _sample(self, pending: DelayedSample) -> GenerationBatchResult:
        result = pending.forward.result()  # done: it ran before this task on the same thread
        assert result.delay_sample_func is not None
        result.delay_sample_func()
        result.delay_sample_func = None
        self.future_map.store_to_map(pending.future_indices, result.next_token_ids)
        return result

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
