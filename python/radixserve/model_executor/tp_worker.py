"""TpModelWorker: the scheduler's handle on one rank's model (its TP shard, its pipeline stage)."""

from __future__ import annotations

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.rank_runtime import RankRuntime
from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch, PPProxyTensors
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.worker_api import WorkerInfo
from radixserve.server_args import ServerArgs
from radixserve.speculative.draft_model import DraftModel
from radixserve.speculative.eagle_draft import EagleDraft
from radixserve.speculative.layer_skip_draft import LayerSkipDraft
from radixserve.speculative.tree_kv import accepted_kv_moves, move_kv
from radixserve.speculative.verify import accept_drafts
from radixserve.utils.process import bound_onednn_caches


class TpModelWorker:
    def __init__(
        self, server_args: ServerArgs, model_config: ModelConfig, rank: RankRuntime | None = None
    ) -> None:
        bound_onednn_caches()  # before the first oneDNN primitive (the weight prepack)
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
        # STANDALONE: drafts for verify steps from a separate draft model with its own KV pool, or
        # from the target's own first layers (self-speculation).
        self.draft: LayerSkipDraft | DraftModel | EagleDraft | None = None
        if server_args.speculative_algorithm in ("EAGLE", "EAGLE3"):
            self.draft = EagleDraft.from_server_args(runner, server_args)
        elif server_args.speculative_algorithm == "STANDALONE":
            if server_args.speculative_draft_model_path:
                self.draft = DraftModel.from_server_args(runner, server_args)
            else:
                assert server_args.speculative_draft_layers, "ServerArgs validation requires one"
                self.draft = LayerSkipDraft(
                    runner,
                    server_args.speculative_draft_layers,
                    server_args.speculative_eagle_topk or 1,
                    server_args.speculative_num_steps or 0,
                )
        self.info = WorkerInfo(
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
        )
        self.stage_link = None
        if rank is not None and rank.layout.pp_size > 1:
            from radixserve.distributed.pipeline import StageLink

            self.stage_link = StageLink(
                rank.groups, model_config.hidden_size, model_config.dtype, runner.device
            )

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult | None:
        """Forward and sample; on a pipeline stage before the last, forward this stage's layers,
        hand the states to the next stage and return None (the last stage samples). With
        batch.delay_sample_launch only the forward runs: the sample is left to the returned
        result's delay_sample_func (see GenerationBatchResult)."""
        proxy = None
        if self.stage_link is not None and self.stage_link.prev is not None:
            proxy = self.stage_link.recv_hidden(int(batch.input_ids.shape[0]))
        if self.draft is not None:
            if batch.forward_mode.is_target_verify():
                self.draft.fill_drafts(batch)
            else:  # the draft's own KV pool follows every token the target sees
                self.draft.shadow(batch)
        # An EAGLE head reads the target's hidden states of every row it keeps.
        eagle = self.draft if isinstance(self.draft, EagleDraft) else None
        fb, out = self.model_runner.forward(
            batch, proxy, capture_hidden=eagle is not None, aux_layers=eagle.aux_layers if eagle else ()
        )
        if eagle is not None and not fb.forward_mode.is_target_verify():
            assert fb.spec_hidden is not None
            eagle.after_target(batch, fb.spec_hidden, None)
        if isinstance(out, PPProxyTensors):
            assert self.stage_link is not None
            self.stage_link.send_hidden(out)
            return None
        logits_output = out
        result = GenerationBatchResult(
            next_token_ids=torch.empty(0, dtype=torch.int64),
            input_token_logprobs=logits_output.input_token_logprobs,
            input_top_logprobs_val=logits_output.input_top_logprobs_val,
            input_top_logprobs_idx=logits_output.input_top_logprobs_idx,
        )

        def sample() -> None:
            drawn = self.model_runner.sample(logits_output, fb)
            result.next_token_ids = drawn.next_token_ids
            result.next_token_logprobs = drawn.next_token_logprobs
            result.top_logprobs_val = drawn.top_logprobs_val
            result.top_logprobs_idx = drawn.top_logprobs_idx
            result.invalid_rows = drawn.invalid_rows
            if fb.forward_mode.is_target_verify():  # never delayed: speculation runs the normal loop
                assert logits_output.all_logits is not None and batch.extend_seq_lens is not None
                assert fb.sampling_info is not None
                result.spec_output_ids, result.spec_num_accepted, paths = accept_drafts(
                    logits_output.all_logits,
                    batch.input_ids,
                    batch.extend_seq_lens,
                    drawn.next_token_ids,
                    fb.sampling_info,
                    self.model_runner.sampler.generator,
                    batch.spec_tree_parents,
                )
                if batch.spec_tree_parents is not None:
                    self._compact_accepted_kv(batch, paths)
                if eagle is not None:  # the head's K/V of the accepted tokens, from the target's states
                    assert fb.spec_hidden is not None
                    eagle.after_target(batch, fb.spec_hidden, paths)

        if batch.delay_sample_launch:
            result.delay_sample_func = sample
        else:
            sample()
        return result

    def _compact_accepted_kv(self, batch: ModelWorkerBatch, paths: list[list[int]]) -> None:
        """A tree's accepted rows to consecutive positions (speculative/tree.py), in the target's
        pool and in a separate draft model's; the scheduler then frees the rows past them."""
        assert batch.extend_seq_lens is not None
        moves = accepted_kv_moves(batch.out_cache_loc, batch.extend_seq_lens, paths)
        if moves is None:
            return
        move_kv(self.token_to_kv_pool, moves)
        if isinstance(self.draft, DraftModel):
            move_kv(self.draft.kv_pool, moves)

    def forward_batch_embedding(self, batch: ModelWorkerBatch) -> EmbeddingBatchResult:
        """Forward a prefill-only batch: one vector per request, nothing sampled."""
        return self.model_runner.forward_embedding(batch)
