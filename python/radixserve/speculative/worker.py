"""SpeculativeWorker: the target worker wrapped with drafting and acceptance (DESIGN.md,
"Speculation as a worker"): draft (or shadow), one target forward, sample, then for a verify
batch accept, compact a tree's KV and feed an EAGLE head. On every rank."""

from __future__ import annotations

from radixserve.layers.logits_processor import LogitsOutput
from radixserve.model_executor.forward_batch import ForwardBatch, GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_executor.worker_api import WorkerLayer
from radixserve.server_args import ServerArgs
from radixserve.speculative.draft_model import DraftModel
from radixserve.speculative.eagle_draft import EagleDraft
from radixserve.speculative.layer_skip_draft import LayerSkipDraft
from radixserve.speculative.tree_kv import accepted_kv_moves, move_kv
from radixserve.speculative.verify import accept_drafts

Draft = LayerSkipDraft | DraftModel | EagleDraft


def select_draft(runner: ModelRunner, server_args: ServerArgs) -> Draft | None:
    """The worker-side draft of --speculative-algorithm (None: NGRAM, whose drafts the scheduler
    finds). STANDALONE drafts with a separate model with its own KV pool, or with the target's
    own first layers over the shared pool (self-speculation)."""
    algo = server_args.speculative_algorithm
    if algo in ("EAGLE", "EAGLE3"):
        return EagleDraft.from_server_args(runner, server_args)
    if algo != "STANDALONE":
        return None
    if server_args.speculative_draft_model_path:
        return DraftModel.from_server_args(runner, server_args)
    assert server_args.speculative_draft_layers, "ServerArgs validation requires one"
    return LayerSkipDraft(
        runner,
        server_args.speculative_draft_layers,
        server_args.speculative_eagle_topk or 1,
        server_args.speculative_num_steps or 0,
    )


class SpeculativeWorker(WorkerLayer):
    def __init__(self, target: TpModelWorker, draft: Draft | None) -> None:
        super().__init__(target)
        self.draft = draft  # tests swap it between runs on one target

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        verify = batch.forward_mode.is_target_verify()
        if self.draft is not None:
            if verify:
                self.draft.fill_drafts(batch)
            else:  # the draft's own KV pool follows every token the target sees
                self.draft.shadow(batch)
        # An EAGLE head reads the target's hidden states of every row it keeps.
        eagle = self.draft if isinstance(self.draft, EagleDraft) else None
        fb, out = self.inner.model_runner.forward(
            batch, capture_hidden=eagle is not None, aux_layers=eagle.aux_layers if eagle else ()
        )
        assert isinstance(out, LogitsOutput), "speculation runs with one pipeline stage"
        if eagle is not None and not verify:
            assert fb.spec_hidden is not None
            eagle.after_target(batch, fb.spec_hidden, None)
        result = self.inner.result_of(batch, fb, out)
        if verify:
            # Sampled already: speculation runs the normal loop, which never delays a sample.
            assert not batch.delay_sample_launch
            self._accept(batch, fb, out, result)
        return result

    def _accept(
        self,
        batch: ModelWorkerBatch,
        fb: ForwardBatch,
        logits_output: LogitsOutput,
        result: GenerationBatchResult,
    ) -> None:
        assert logits_output.all_logits is not None and batch.extend_seq_lens is not None
        assert fb.sampling_info is not None
        result.spec_output_ids, result.spec_num_accepted, paths = accept_drafts(
            logits_output.all_logits,
            batch.input_ids,
            batch.extend_seq_lens,
            result.next_token_ids,
            fb.sampling_info,
            self.inner.model_runner.sampler.generator,
            batch.spec_tree_parents,
        )
        if batch.spec_tree_parents is not None:
            self._compact_accepted_kv(batch, paths)
        if isinstance(
            self.draft, EagleDraft
        ):  # the head's K/V of the accepted tokens, from the target's states
            assert fb.spec_hidden is not None
            self.draft.after_target(batch, fb.spec_hidden, paths)

    def _compact_accepted_kv(self, batch: ModelWorkerBatch, paths: list[list[int]]) -> None:
        """A tree's accepted rows to consecutive positions (speculative/tree.py), in the target's
        pool and in a separate draft model's; the scheduler then frees the rows past them."""
        assert batch.extend_seq_lens is not None
        moves = accepted_kv_moves(batch.out_cache_loc, batch.extend_seq_lens, paths)
        if moves is None:
            return
        move_kv(self.pools.token_to_kv_pool, moves)
        if isinstance(self.draft, DraftModel):
            move_kv(self.draft.kv_pool, moves)
