"""The one place that assembles a rank's worker stack from the resolved config."""

from __future__ import annotations

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.rank_runtime import RankRuntime
from radixserve.model_executor.stage_worker import PipelineStageWorker
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.speculative.worker import SpeculativeWorker, select_draft

Worker = TpModelWorker | SpeculativeWorker | PipelineStageWorker


def build_model_worker(
    server_args: ServerArgs,
    model_config: ModelConfig,
    rank: RankRuntime | None = None,
    device: str | None = None,
) -> Worker:
    """TpModelWorker, wrapped by a PipelineStageWorker with --pp-size > 1 or by a
    SpeculativeWorker with --speculative-algorithm (the two never combine: ServerArgs refuses
    speculation with --pp-size > 1)."""
    target = TpModelWorker(server_args, model_config, rank, device)
    if rank is not None and rank.layout.pp_size > 1:
        return PipelineStageWorker.for_rank(target, rank)
    if server_args.speculative_algorithm is not None:
        return SpeculativeWorker(target, select_draft(target.model_runner, server_args))
    return target
