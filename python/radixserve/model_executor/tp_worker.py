"""TpModelWorker: the scheduler's handle on one rank's model (its TP shard, its pipeline stage)."""

from __future__ import annotations

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.rank_runtime import RankRuntime
from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch, PPProxyTensors
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs
from radixserve.speculative.layer_skip_draft import LayerSkipDraft
from radixserve.speculative.verify import accept_drafts


class TpModelWorker:
    def __init__(
        self, server_args: ServerArgs, model_config: ModelConfig, rank: RankRuntime | None = None
    ) -> None:
        if not model_config.is_generation and rank is not None and rank.layout.pp_size > 1:
            raise ValueError("embedding and classification models do not run with --pp-size > 1")
        self.model_runner = ModelRunner(server_args, model_config, rank)
        runner = self.model_runner
        self.model_config = model_config
        self.rank = rank
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_req_num = runner.max_req_num
        self.max_context_len = model_config.context_len
        self.vocab_size = model_config.vocab_size
        self.device = runner.device
        # Self-speculation (STANDALONE with --speculative-draft-layers): drafts for verify steps.
        self.draft = None
        if server_args.speculative_algorithm == "STANDALONE" and server_args.speculative_draft_layers:
            self.draft = LayerSkipDraft(runner, server_args.speculative_draft_layers)
        self.is_generation = model_config.is_generation
        self.embedding_config = runner.embedding_config
        # Encoders attend bidirectionally: a token's KV depends on later tokens, so none is shared.
        self.is_causal = runner.embedding_config.is_causal
        self.stage_link = None
        if rank is not None and rank.layout.pp_size > 1:
            from radixserve.distributed.pipeline import StageLink

            self.stage_link = StageLink(
                rank.groups, model_config.hidden_size, model_config.dtype, runner.device
            )

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult | None:
        """Forward and sample; on a pipeline stage before the last, forward this stage's layers,
        hand the states to the next stage and return None (the last stage samples)."""
        proxy = None
        if self.stage_link is not None and self.stage_link.prev is not None:
            proxy = self.stage_link.recv_hidden(int(batch.input_ids.shape[0]))
        if self.draft is not None and batch.forward_mode.is_target_verify():
            self.draft.fill_drafts(batch)
        fb, out = self.model_runner.forward(batch, proxy)
        if isinstance(out, PPProxyTensors):
            assert self.stage_link is not None
            self.stage_link.send_hidden(out)
            return None
        sample = self.model_runner.sample(out, fb)
        spec_output_ids = spec_num_accepted = None
        if fb.forward_mode.is_target_verify():
            assert out.all_logits is not None and batch.extend_seq_lens is not None
            assert fb.sampling_info is not None
            spec_output_ids, spec_num_accepted = accept_drafts(
                out.all_logits,
                batch.input_ids,
                batch.extend_seq_lens,
                sample.next_token_ids,
                fb.sampling_info,
                self.model_runner.sampler.generator,
            )
        return GenerationBatchResult(
            next_token_ids=sample.next_token_ids,
            next_token_logprobs=sample.next_token_logprobs,
            top_logprobs_val=sample.top_logprobs_val,
            top_logprobs_idx=sample.top_logprobs_idx,
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs_val=out.input_top_logprobs_val,
            input_top_logprobs_idx=out.input_top_logprobs_idx,
            spec_output_ids=spec_output_ids,
            spec_num_accepted=spec_num_accepted,
        )

    def forward_batch_embedding(self, batch: ModelWorkerBatch) -> EmbeddingBatchResult:
        """Forward a prefill-only batch: one vector per request, nothing sampled."""
        return self.model_runner.forward_embedding(batch)
