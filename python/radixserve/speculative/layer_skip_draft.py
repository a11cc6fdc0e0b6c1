"""Self-speculation: the target's own first layers, its final norm and its LM head as the draft
model (an early exit, as in LayerSkip), for models with no separate draft. Runs in the model worker.

It needs no KV pool of its own: layer l's K/V of a token depends only on layers below l, so the
draft's layers 0..L-1 and the target's compute the same K/V for the same tokens, and the draft
reads the target's pool for every accepted position. For its own draft positions the draft writes
layers 0..L-1 into the slots the verify step allocated; the verify forward then overwrites every
layer of them.

Per verify step with k drafts: k single-token forwards through L layers (a decode of 1 + the
previous drafts over the cached KV), then the usual verify forward of the target.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.speculative.draft_tree import fill_tree_drafts

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner


class LayerSkipDraft:
    def __init__(self, runner: ModelRunner, num_layers: int, topk: int = 1, num_steps: int = 0) -> None:
        inner = runner.model.model  # LlamaModel (Llama, Qwen2, Qwen3 share it)
        if not 0 < num_layers < len(inner.layers):
            raise ValueError(
                f"--speculative-draft-layers must be between 1 and {len(inner.layers) - 1} "
                f"(the target has {len(inner.layers)} layers), got {num_layers}"
            )
        self.runner = runner
        self.embed = inner.embed_tokens
        self.layers = inner.layers[:num_layers]
        self.norm = inner.norm
        self.lm_head = runner.lm_head
        self.topk, self.num_steps = topk, num_steps  # topk > 1: draft trees (draft_tree.py)

    @torch.inference_mode()
    def fill_drafts(self, batch: ModelWorkerBatch) -> None:
        # The verify forward writes every layer of every row into the shared pool: the draft
        # need not write the last draft's K/V.
        if self.topk > 1:
            fill_tree_drafts(batch, self._row_logits, self.topk, self.num_steps, write_every_row=False)
        else:
            fill_chain_drafts(batch, self._next_tokens, write_every_row=False)

    def shadow(self, batch: ModelWorkerBatch) -> None:
        """Nothing to do: the target's forward writes the draft's layers (they are its own)."""

    def _hidden(self, batch: ModelWorkerBatch) -> torch.Tensor:
        r = self.runner
        fb = ForwardBatch.init_new(batch, r.req_to_token_pool, r.token_to_kv_pool, r.attn_backend, r.device)
        hidden, residual = self.embed(fb.input_ids), None  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _next_tokens(self, batch: ModelWorkerBatch) -> torch.Tensor:
        return self.lm_head(self._hidden(batch)).float().argmax(dim=-1).cpu()  # [bs]

    def _row_logits(self, batch: ModelWorkerBatch, rows: list[int]) -> torch.Tensor:
        hidden = self._hidden(batch)
        if not rows:  # a pass that only writes the draft's K/V (and linear_f32 takes no empty input)
            return torch.empty(0)
        return self.lm_head(hidden[rows]).float().cpu()  # [len(rows), vocab]


def fill_chain_drafts(
    batch: ModelWorkerBatch,
    next_tokens: Callable[[ModelWorkerBatch], torch.Tensor],
    write_every_row: bool,
) -> None:
    """Replace the placeholder drafts of a TARGET_VERIFY batch (rows 1..k of each request) by a
    draft model's greedy tokens, in place on batch.input_ids: decode step j feeds each request's
    row j (the last accepted token, then its drafts) into `next_tokens`, which writes that row's
    draft K/V into the row's slot and returns the next token per request. `write_every_row` runs
    one more step so the last draft's K/V is written too (a draft with its own pool needs it when
    every draft is accepted); a request without drafts (one row) then still gets its row's K/V."""
    assert batch.extend_seq_lens is not None and batch.extend_prefix_lens is not None
    lens, prefix = batch.extend_seq_lens, batch.extend_prefix_lens
    rows_written = list(lens) if write_every_row else [n - 1 for n in lens]
    starts = list(itertools.accumulate(lens, initial=0))  # first row of each request
    input_ids = batch.input_ids.clone()  # [num_tokens]
    for step in range(max(rows_written, default=0)):
        rows = [b for b, n in enumerate(rows_written) if n > step]  # requests with a row here
        at = [starts[b] + step for b in rows]  # this step's input token and KV slot per request
        step_batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=input_ids[at],
            req_pool_indices=batch.req_pool_indices[rows],
            seq_lens=torch.tensor([prefix[b] + step + 1 for b in rows], dtype=torch.int64),
            out_cache_loc=batch.out_cache_loc[at],
            sampling_info=None,
        )
        tokens = next_tokens(step_batch)  # [len(rows)]
        keep = [i for i, b in enumerate(rows) if step + 1 < lens[b]]  # the next row is a draft
        if keep:
            input_ids[[at[i] + 1 for i in keep]] = tokens[keep]
    batch.input_ids = input_ids
