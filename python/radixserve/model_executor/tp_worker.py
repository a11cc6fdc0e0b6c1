"""TpModelWorker: one rank's model (its TP shard, its pipeline stage): forward, then sample.

It knows nothing of speculation or of the other pipeline stages: a SpeculativeWorker
(speculative/worker.py) or a PipelineStageWorker (model_executor/stage_worker.py) wraps it for
those, and `worker_stack.build_model_worker` assembles the stack.
"""

from __future__ import annotations

import dataclasses

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.rank_runtime import RankRuntime
from radixserve.layers.logits_processor import LogitsOutput
from radixserve.layers.sampler import SampleOutput
from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import ForwardBatch, GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.worker_api import KVPools, WorkerInfo
from radixserve.server_args import ServerArgs
from radixserve.utils.process import bound_onednn_caches

# A result's tokens before its sample ran (one shared empty tensor: a torch op per step saved).
_NOT_SAMPLED = torch.empty(0, dtype=torch.int64)
_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(SampleOutput))


class TpModelWorker:
    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig,
        rank: RankRuntime | None = None,
        device: str | None = None,  # this rank's (ServerArgs.rank_device); None: the resolved device
    ) -> None:
        bound_onednn_caches()  # before the first oneDNN primitive (the weight prepack)
        if not model_config.is_generation and rank is not None and rank.layout.pp_size > 1:
            raise ValueError("embedding and classification models do not run with --pp-size > 1")
        self.model_runner = ModelRunner(server_args, model_config, rank, device)
        runner = self.model_runner
        self.model_config = model_config
        self.pools = KVPools(
            runner.req_to_token_pool,
            runner.token_to_kv_pool_allocator,
            runner.max_total_num_tokens,
            runner.max_req_num,
            model_config.context_len,
            runner.token_to_kv_pool,
        )
        self.info = WorkerInfo(
            vocab_size=model_config.vocab_size,
            device=runner.device,
            is_generation=model_config.is_generation,
            is_causal=runner.embedding_config.is_causal,
            embedding_config=runner.embedding_config,
            tp_rank=runner.parallel.tp.rank,
            tp_size=runner.parallel.tp.size,
            pp_rank=runner.parallel.pp_rank,
            pp_size=runner.parallel.pp_size,
            num_attention_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads,
            weights=runner.weights,
            lora=runner.lora,
            takes_images=bool(getattr(runner.model, "takes_images", False)),
            mm_cache=getattr(runner.model, "mm_cache", None),
            expert_recorder=runner.expert_recorder,
        )

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Forward and sample. With batch.delay_sample_launch only the forward runs: the sample
        is left to the returned result's delay_sample_func (see GenerationBatchResult)."""
        fb, out = self.model_runner.forward(batch)
        assert isinstance(out, LogitsOutput), "a pipeline stage runs behind a PipelineStageWorker"
        return self.result_of(batch, fb, out)

    def result_of(
        self, batch: ModelWorkerBatch, fb: ForwardBatch, logits_output: LogitsOutput
    ) -> GenerationBatchResult:
        """The batch's result from its forward's logits: sampled now, or with
        batch.delay_sample_launch by the result's delay_sample_func."""
        result = GenerationBatchResult(
            next_token_ids=_NOT_SAMPLED,
            input_token_logprobs=logits_output.input_token_logprobs,
            input_top_logprobs_val=logits_output.input_top_logprobs_val,
            input_top_logprobs_idx=logits_output.input_top_logprobs_idx,
            input_token_ids_logprobs_val=logits_output.input_token_ids_logprobs_val,
            hidden_states=hidden_rows(batch, logits_output.hidden_states),
        )

        def sample() -> None:
            drawn = self.model_runner.sample(logits_output, fb)
            for name in _SAMPLE_FIELDS:  # every SampleOutput field, under the same name
                setattr(result, name, getattr(drawn, name))

        if batch.delay_sample_launch:
            result.delay_sample_func = sample
        else:
            sample()
        return result

    def forward_batch_embedding(self, batch: ModelWorkerBatch) -> EmbeddingBatchResult:
        """Forward a prefill-only batch: one vector per request, nothing sampled."""
        return self.model_runner.forward_embedding(batch)


def hidden_rows(batch: ModelWorkerBatch, hidden: torch.Tensor | None) -> list[torch.Tensor | None] | None:
    """Each asking request's rows of the final states, copied to fp32 CPU tensors now: a fast
    decode path (CPU fused decode, CUDA graph) writes the next forward's states into the same
    buffer, which may also be padded past the batch."""
    asked = batch.return_hidden_states
    if asked is None or hidden is None:
        return None
    counts = batch.extend_seq_lens if batch.forward_mode.is_extend() else [1] * batch.batch_size
    assert counts is not None
    out: list[torch.Tensor | None] = []
    start = 0
    for wants, n in zip(asked, counts):
        out.append(hidden[start : start + n].to("cpu", torch.float32, copy=True) if wants else None)
        start += n
    return out
