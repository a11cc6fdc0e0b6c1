"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous block of vocab rows.

The vocabulary is padded up to a multiple of tp_size so every rank's block has the same size;
padding rows are zero and never looked up (ids are < vocab_size), and their logits are cut off
after the gather. At tp_size 1 the embedding is a plain lookup over a [vocab_size, hidden] weight
and the head a plain Linear, exactly as before.

- Embedding: a rank looks up the ids inside its block, writes zeros for the others, and an
  all-reduce assembles the full rows (each id has exactly one non-zero contribution).
- LM head: a rank computes the logits of its block, and an all-gather concatenates the blocks;
  every rank ends with the same full logits, so every rank samples the same token.

A GGUF file's quantized token embedding (an untied model's: a tied one's rows are the LM head's)
serves from the file's integers alone (`weight_wq`, attached by model_executor/weight_only_forms.py):
the fp32 block is dropped (its parameter kept on the meta device, shape and dtype intact) and each
lookup dequantizes the rows it reads, which are exactly the fp32 rows the conversion holds. A
weight update brings the fp32 block back first (`materialize_fp32`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.group_quant_ops import take_rows
from radixserve.layers.linear import Linear
from radixserve.layers.param_storage import replace_storage
from radixserve.model_loader.errors import check_shape
from radixserve.model_loader.weights import CheckpointTensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelComm) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.rows_per_rank = -(-vocab_size // tp.size)  # ceil: the padded vocab split evenly
        self.vocab_start = tp.rank * self.rows_per_rank
        # Rows of this block that are real tokens (the last rank's block may end in padding).
        self.num_valid_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size))  # [rows, hidden]
        # The block's rows as a GGUF file's integers; with the fp32 block dropped, the only copy.
        self.weight_wq: GroupQuantWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden_size]."""
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)  # [num_tokens]
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(out)

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.fp32_dropped:
            return F.embedding(rows, self.weight)
        assert self.weight_wq is not None
        flat = take_rows(self.weight_wq, rows.reshape(-1)).dequantize()
        return flat.view(*rows.shape, flat.shape[-1])

    @property
    def fp32_dropped(self) -> bool:
        return self.weight.is_meta

    def drop_fp32(self, form: GroupQuantWeight) -> None:
        """Serve lookups from `form` alone (the caller checked it dequantizes to the block)."""
        self.weight_wq = form
        replace_storage(self.weight, torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"))

    def materialize_fp32(self) -> None:
        """Bring the dropped fp32 block back as the form's dequantization (an update writes into
        it; attaching the form again drops it where it did not change)."""
        if self.fp32_dropped:
            assert self.weight_wq is not None
            replace_storage(self.weight, self.weight_wq.dequantize().to(self.weight.dtype))

    def valid_rows(self, limit: int) -> torch.Tensor:
        """The first min(limit, num_valid_rows) rows of this block (a weight read), in fp32 from
        the form when the fp32 block is dropped: only the rows asked for are dequantized."""
        rows = max(0, min(limit, self.num_valid_rows))
        if not self.fp32_dropped:
            return self.weight[:rows]
        assert self.weight_wq is not None
        return take_rows(self.weight_wq, slice(0, rows)).dequantize()

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        check_shape(loaded.name, (self.vocab_size, *param.shape[1:]), loaded.shape)
        rows = self.num_valid_rows
        if rows:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows).to(param.dtype))


class GatheredLMHead(nn.Module):
    """Logits over the whole vocabulary from a rank's block of LM-head rows."""

    def __init__(self, local_head: Linear, vocab_size: int, tp: TensorParallelComm) -> None:
        super().__init__()
        self.local_head = local_head  # [rows_per_rank, hidden] weight
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size]."""
        local = self.local_head(hidden)  # [n, rows_per_rank]
        return self.tp.all_gather(local)[:, : self.vocab_size]


def make_lm_head(weight: nn.Parameter, vocab_size: int, tp: TensorParallelComm) -> nn.Module:
    """A Linear over the (possibly tied) head weight, gathered across ranks when sharded; the
    weight is shared, not copied, so it gets the CPU fast paths once."""
    head = Linear.sharing(weight)
    return head if tp.size == 1 else GatheredLMHead(head, vocab_size, tp)
