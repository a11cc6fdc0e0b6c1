"""Tensor-parallel linear layers (Megatron's split): each TP rank holds a shard of the weight and
loads only that shard from the checkpoint.

- Column-parallel (QKV, gate/up): output features split; each rank computes its slice of the
  output and needs no communication.
- Row-parallel (o_proj, down): input features split; each rank computes a partial sum of the full
  output and an all-reduce adds them. A bias is added once, after the all-reduce.

All of them are `Linear`s over their local shard, so the CPU fast paths (oneDNN prepacking, fp16
copies, the small-batch kernels, int8 quantization) apply unchanged. Quantized, each rank's shard
gets its own per-output-channel scales: a column-parallel rank holds whole output channels (their
scales are the unsharded model's), a row-parallel rank scales its part of each channel's inputs. At tp_size 1 every layer is exactly the Linear
it replaces: same parameter shapes, same checkpoint names, same arithmetic.

Loading: `weight_loader(param, tensor, shard_id)` copies the rank's part of a checkpoint tensor
(a CheckpointTensor, read by slice) into the local parameter; `shard_id` names the HF projection
of a fused layer ("q"/"k"/"v", or the index of gate/up).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.distributed.layout import HeadShard
from radixserve.layers.linear import Linear, linear
from radixserve.model_loader.errors import ModelLoadError, check_shape, copy_checked
from radixserve.model_loader.weights import CheckpointTensor


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ModelLoadError(f"{what} ({total}) is not divisible by --tp-size {parts}")
    return total // parts


class ColumnParallelLinear(Linear):
    """y[:, rank's slice] = x @ W[rank's rows].T (+ b[rank's slice])."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelComm) -> None:
        super().__init__(in_features, divide(out_features, tp.size, "output features"), bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        rows = param.shape[0]
        check_shape(loaded.name, (rows * self.tp.size, *param.shape[1:]), loaded.shape)
        copy_checked(param.data, loaded.narrow(0, self.tp.rank * rows, rows), loaded.name)


class MergedColumnParallelLinear(Linear):
    """Several column-parallel projections of the same input fused into one GEMM (gate_up): the
    local weight is [gate shard; up shard]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TensorParallelComm) -> None:
        self.local_sizes = [divide(n, tp.size, "output features") for n in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        index = int(shard_id)  # type: ignore[call-overload]
        size = self.local_sizes[index]
        dst = param.data.narrow(0, sum(self.local_sizes[:index]), size)
        check_shape(loaded.name, (size * self.tp.size, *param.shape[1:]), loaded.shape)
        copy_checked(dst, loaded.narrow(0, self.tp.rank * size, size), loaded.name)


class QKVParallelLinear(Linear):
    """The fused q/k/v projection of attention, split by heads: the rank holds the query heads and
    KV heads of its HeadShard (whole KV groups, or a replicated KV head: distributed/layout.py)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelComm,
        heads: HeadShard | None = None,  # default: all heads (a single rank)
    ) -> None:
        self.head_dim = head_dim
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.heads = heads or HeadShard(0, num_heads, 0, num_kv_heads)
        self.num_heads, self.num_kv_heads = self.heads.q_count, self.heads.kv_count
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            dst_start, size, src_start = 0, self.q_size, self.heads.q_start * d
            check_shape(loaded.name, (self.total_heads * d, *param.shape[1:]), loaded.shape)
        elif shard_id in ("k", "v"):
            dst_start = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_start = self.kv_size, self.heads.kv_start * d
            check_shape(loaded.name, (self.total_kv_heads * d, *param.shape[1:]), loaded.shape)
        else:
            raise ModelLoadError(f"{loaded.name}: unknown q/k/v shard {shard_id!r}")
        copy_checked(param.data.narrow(0, dst_start, size), loaded.narrow(0, src_start, size), loaded.name)


class RowParallelLinear(Linear):
    """y = all_reduce(x[:, rank's slice] @ W[:, rank's slice].T) + b.

    The rank's input slice is [input_start, input_start + input_size): an even split by default,
    or the columns of the rank's attention heads for o_proj (which may be uneven)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallelComm,
        input_slice: tuple[int, int] | None = None,  # (start, size); default: an even split
    ) -> None:
        if input_slice is None:
            size = divide(in_features, tp.size, "input features")
            input_slice = (tp.rank * size, size)
        self.input_start, self.input_size = input_slice
        self.total_in_features = in_features
        super().__init__(self.input_size, out_features, bias=bias)
        self.tp = tp
        # Added to the rank's partial output before the all-reduce (LoRA at --tp-size > 1:
        # lora/tp_shards.py): (x, out) -> None, adding into out.
        self.partial_delta: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias: whole on every rank, added after the reduction
            copy_checked(param.data, loaded.full(), loaded.name)
            return
        check_shape(loaded.name, (param.shape[0], self.total_in_features), loaded.shape)
        copy_checked(param.data, loaded.narrow(1, self.input_start, self.input_size), loaded.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = linear(x, self.weight, None, *self.derived_forms())  # [n, out] partial
        if self.partial_delta is not None:
            self.partial_delta(x, out)
        self.tp.all_reduce_(out)
        return out if self.bias is None else out.add_(self.bias)
