"""Reading a checkpoint weight back from a sharded model (/get_weights_by_name).

Each rank holds a part of a checkpoint tensor: a block of rows (column-parallel projections, the
vocabulary-parallel embedding and head), a block of columns (row-parallel projections), a copy of
the whole tensor (norms, a replicated KV head), or nothing (another pipeline stage). `read_piece`
says which part, in the full tensor's coordinates, cut to the first `truncate_size` rows;
`assemble` puts the pieces of every rank together. So the answer is the first `truncate_size`
rows of the full (unsharded) checkpoint tensor at any TP/PP layout, as at a single rank; an
answer of more than MAX_WEIGHT_REPLY_ELEMENTS values is refused before anything is copied.

SGLang answers the same at TP>1 for row-parallel weights (it all-gathers o_proj and down_proj
along their input dimension) and returns TP rank 0's rows for the others, which are the full
tensor's first rows while `truncate_size` does not exceed a rank's rows; radixserve gathers rows
from the next ranks past that point instead of stopping short.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixserve.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.vocab_parallel import VocabParallelEmbedding
from radixserve.managers.control_messages import weight_reply_error
from radixserve.models.llama import fused_target


class WeightReadError(ValueError):
    """A weight that cannot be read (unknown name, released weights)."""


@dataclass(frozen=True)
class WeightPiece:
    """`tensor` covers [start, start + tensor.shape[dim]) along `dim` of the full checkpoint tensor
    of shape `full_shape`, already cut to the first rows asked for; `dim` None: the whole tensor
    (this rank holds a copy)."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None
    start: int


def read_piece(model: nn.Module, name: str, truncate_size: int) -> WeightPiece | None:
    """This rank's part of checkpoint weight `name`, or None when this rank holds none of it
    (another pipeline stage)."""
    params = dict(model.named_parameters())
    if name in params:  # an unfused parameter under its own name (norms, embeddings, o_proj)
        target, shard = name, None
    else:
        targets = model.param_targets(name)  # type: ignore[operator]
        if not targets:
            if name.startswith("lm_head.") and getattr(model, "tie_word_embeddings", False):
                # Tied head: SGLang answers with the embedding it shares.
                return read_piece(model, "model.embed_tokens." + name.removeprefix("lm_head."), truncate_size)
            return None
        target, shard = targets[0], fused_target(name)[1]
        if target not in params:
            raise WeightReadError(f"The model has no weight named {name!r}.")
    param = params[target].detach()
    if param.numel() == 0:
        raise WeightReadError("The weights are released (/resume_memory_occupation restores them).")
    owner = model.get_submodule(target.rpartition(".")[0]) if "." in target else model
    per_expert = getattr(owner, "checkpoint_piece", None)  # MoE experts: one slot of a stacked weight
    if per_expert is not None:
        slot, full_shape, dim, start = per_expert(name, param)
        _check_size(name, full_shape, truncate_size)
        if slot is None:  # an expert another rank holds (--ep-size)
            return None
        piece = WeightPiece(slot, full_shape, dim, start)
    else:
        piece = _locate(owner, param, shard, truncate_size)
        _check_size(name, piece.full_shape, truncate_size)
    return _cut(piece, truncate_size)


def _check_size(name: str, full_shape: tuple[int, ...], truncate_size: int) -> None:
    too_large = weight_reply_error(name, full_shape, truncate_size)
    if too_large is not None:  # before any copy: every rank refuses alike (same full shape)
        raise WeightReadError(too_large)


def _locate(
    owner: nn.Module, param: torch.Tensor, shard: str | int | None, truncate_size: int
) -> WeightPiece:
    """Where this rank's `param` (or its part `shard` of a fused parameter) sits in the full
    checkpoint tensor (an embedding: only the rows below `truncate_size`, which may have to be
    dequantized)."""
    rest = tuple(param.shape[1:])
    if isinstance(owner, (QKVParallelLinear, MergedColumnParallelLinear)) and shard is None:
        # The fused parameter asked for by its own name: whole at one rank; sharded, its ranks'
        # blocks interleave the projections, so no single full tensor exists to read.
        if owner.tp.size > 1:
            raise WeightReadError("A fused parameter at --tp-size > 1: ask for its checkpoint names.")
        return WeightPiece(param, tuple(param.shape), None, 0)
    if isinstance(owner, QKVParallelLinear):
        d = owner.head_dim
        if shard == "q":
            local, start, rows = (
                param.narrow(0, 0, owner.q_size),
                owner.heads.q_start * d,
                owner.total_heads * d,
            )
        else:
            offset = owner.q_size + (owner.kv_size if shard == "v" else 0)
            local = param.narrow(0, offset, owner.kv_size)
            start, rows = owner.heads.kv_start * d, owner.total_kv_heads * d
        return WeightPiece(local, (rows, *rest), 0, start)
    if isinstance(owner, MergedColumnParallelLinear):
        index = int(shard or 0)  # type: ignore[arg-type]
        size = owner.local_sizes[index]
        local = param.narrow(0, sum(owner.local_sizes[:index]), size)
        return WeightPiece(local, (size * owner.tp.size, *rest), 0, owner.tp.rank * size)
    if isinstance(owner, ColumnParallelLinear):
        rows = param.shape[0]
        return WeightPiece(param, (rows * owner.tp.size, *rest), 0, owner.tp.rank * rows)
    if isinstance(owner, RowParallelLinear) and param.dim() == 2:
        full = (param.shape[0], owner.total_in_features)
        return WeightPiece(param, full, 1, owner.input_start)
    if isinstance(owner, VocabParallelEmbedding):
        # The last block may end in padding rows; a GGUF embedding's rows may exist as integers only.
        local = owner.valid_rows(truncate_size - owner.vocab_start)
        return WeightPiece(local, (owner.vocab_size, *rest), 0, owner.vocab_start)
    return WeightPiece(param, tuple(param.shape), None, 0)


def _cut(piece: WeightPiece, truncate_size: int) -> WeightPiece:
    """Keep only the rows below `truncate_size` (what the answer shows), so that little crosses
    the ranks whatever the weight's size."""
    t = piece.tensor
    if t.dim() == 0:
        return piece
    if piece.dim == 0:
        t = t[: max(0, min(t.shape[0], truncate_size - piece.start))]  # maybe none of its rows
    else:
        t = t[: max(truncate_size, 0)]
    return WeightPiece(t.float().clone(), piece.full_shape, piece.dim, piece.start)


def assemble(pieces: list[WeightPiece | None], truncate_size: int) -> torch.Tensor:
    """The first `truncate_size` rows of the full tensor from every rank's piece (float32)."""
    found = [p for p in pieces if p is not None]
    if not found:
        raise WeightReadError("no rank holds it")
    full = found[0].full_shape
    if not full:
        return found[0].tensor
    shape = (min(full[0], max(truncate_size, 0)), *full[1:])
    out = torch.zeros(shape, dtype=torch.float32)
    covered = torch.zeros(shape, dtype=torch.bool)
    for p in found:
        if p.dim is None:
            index: tuple[slice, ...] = (slice(0, p.tensor.shape[0]),)
        else:
            index = (slice(None),) * p.dim + (slice(p.start, p.start + p.tensor.shape[p.dim]),)
        out[index] = p.tensor
        covered[index] = True
    if not bool(covered.all()):
        raise WeightReadError("the ranks' shards do not cover the whole tensor")
    return out
