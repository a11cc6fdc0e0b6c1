"""TpModelWorker: the scheduler's handle on one tensor-parallel rank's model."""

from __future__ import annotations

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        self.model_runner = ModelRunner(server_args, model_config)
        runner = self.model_runner
        self.model_config = model_config
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_req_num = runner.max_req_num
        self.max_context_len = model_config.context_len
        self.vocab_size = model_config.vocab_size
        self.device = runner.device

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        fb, logits_output = self.model_runner.forward(batch)
        sample = self.model_runner.sample(logits_output, fb)
        return GenerationBatchResult(
            next_token_ids=sample.next_token_ids,
            next_token_logprobs=sample.next_token_logprobs,
            top_logprobs_val=sample.top_logprobs_val,
            top_logprobs_idx=sample.top_logprobs_idx,
            input_token_logprobs=logits_output.input_token_logprobs,
            input_top_logprobs_val=logits_output.input_top_logprobs_val,
            input_top_logprobs_idx=logits_output.input_top_logprobs_idx,
        )
