"""PipelineStageWorker: a pipeline stage's worker (--pp-size > 1). A stage after the first
receives the previous stage's hidden states and residual before its forward; a stage before the
last sends its own to the next stage and returns no result (the last stage samples; the loop
brings the sampled result back over the same StageLink, distributed/pipeline.py)."""

from __future__ import annotations

from radixserve.distributed.pipeline import StageLink
from radixserve.distributed.rank_runtime import RankRuntime
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch, PPProxyTensors
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_executor.worker_api import WorkerLayer


class PipelineStageWorker(WorkerLayer):
    def __init__(self, inner: TpModelWorker, stage_link: StageLink) -> None:
        super().__init__(inner)
        self.stage_link = stage_link  # the pipelined loop sends inputs and results over it too

    @classmethod
    def for_rank(cls, inner: TpModelWorker, rank: RankRuntime) -> PipelineStageWorker:
        config = inner.model_config
        return cls(inner, StageLink(rank.groups, config.hidden_size, config.dtype, inner.info.device))

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult | None:
        """Forward this stage's layers; None on a stage before the last (its states went on)."""
        link = self.stage_link
        proxy = link.recv_hidden(int(batch.input_ids.shape[0])) if link.prev is not None else None
        fb, out = self.inner.model_runner.forward(batch, proxy)
        if isinstance(out, PPProxyTensors):
            link.send_hidden(out)
            return None
        return self.inner.result_of(batch, fb, out)
