"""FusedMoE: the experts of one MoE layer, their weights stacked so every kernel reads one tensor.

w13_weight [num_experts, 2 * inter, hidden_size] holds each expert's gate rows then up rows (the
layout of a dense layer's gate_up_proj); w2_weight [num_experts, hidden_size, inter] its down
projection. Under tensor parallelism each rank holds a slice of every expert's intermediate
dimension (inter = moe_intermediate_size / tp_size) and the combined output, a partial sum, is
all-reduced, as a dense MLP's row-parallel down projection is. The router and the top-k choice are
replicated, so every rank routes every token the same way.

Under expert parallelism (--ep-size E, dividing tp_size) the TP ranks form E groups of tp_size / E:
group g holds experts [g * n / E, (g + 1) * n / E) whole along their width across its group (each
rank a 1 / (tp_size / E) slice, as above). Every rank still sees every token (attention is
tensor-parallel, its output replicated), so a rank runs its own experts over the tokens routed to
them and the same all-reduce adds up every rank's part: no all-to-all is needed, and the exchange is
the one TP already pays (docs/models.md says what was measured).

Checkpoints store one tensor per expert and projection (HF's `experts.{e}.gate_proj.weight`,
Mixtral's `experts.{e}.w1.weight`); `weight_loader` copies each into its expert's slot, reading
only this rank's slice.

With quantized experts attached (`attach_quantized`, --quantization gguf) the fp32 stacked weights
are dropped: w13_weight / w2_weight keep their shapes on the meta device and hold no memory. A
weight update brings them back first (`materialize_fp32`: the forms' exact dequantization) so it
has something to write into; a read (/get_weights_by_name) dequantizes the one expert it asks for.
A GGUF model's experts never have an fp32 copy at all: the loader builds the layers under
`experts_on_meta()` and attaches the file's forms, or fills the fp32 weights it allocates for them
expert by expert (model_loader/gguf_experts.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator

import torch
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.layers.moe.fused_moe_a8 import experts_on_panels
from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.int8_experts import ExpertsInt8
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq
from radixserve.layers.parallel_linear import divide
from radixserve.layers.param_storage import replace_storage
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor

# `experts.{id}.{projection}.weight` -> which part of the stacked weights it fills.
EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")
# Set while a loader builds a model whose experts come from elsewhere than the checkpoint folder.
_EXPERTS_ON_META = contextvars.ContextVar("experts_on_meta", default=False)


@contextlib.contextmanager
def experts_on_meta() -> Iterator[None]:
    """FusedMoE layers built inside the block create w13_weight / w2_weight on the meta device:
    shapes only, no storage, so a GGUF's experts are never held in fp32 unless asked for."""
    token = _EXPERTS_ON_META.set(True)
    try:
        yield
    finally:
        _EXPERTS_ON_META.reset(token)


def expert_param_name(name: str) -> str | None:
    """The stacked parameter a per-expert checkpoint tensor loads into (`...experts.w13_weight` or
    `...experts.w2_weight`), or None when `name` is not an expert weight."""
    match = EXPERT_WEIGHT.search(name)
    if match is None:
        return None
    stacked = "w2_weight" if match.group(2) in _DOWN else "w13_weight"
    return f"{name[: match.start()]}.experts.{stacked}"


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallelComm,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts  # of the layer, over every rank
        self.tp, self.ep_size = tp, ep_size
        if tp.size % ep_size or num_experts % ep_size:
            raise ModelLoadError(
                f"--ep-size {ep_size} must divide --tp-size ({tp.size}) and the layer's {num_experts} experts"
            )
        moe_tp = tp.size // ep_size  # the ranks that share one expert's width
        self.moe_tp_rank = tp.rank % moe_tp
        self.num_local = num_experts // ep_size
        self.expert_start = (tp.rank // moe_tp) * self.num_local  # this rank's first expert
        self.inter = divide(intermediate_size, moe_tp, "moe intermediate size")  # this rank's part
        device = "meta" if _EXPERTS_ON_META.get() else None  # None: the surrounding default device
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * self.inter, hidden_size, device=device)
        )
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden_size, self.inter, device=device))
        # The local experts' weight-only quantized forms (--quantization gguf), set after loading,
        # and the buffer large groups dequantize into (shared by the model's MoE layers).
        self.experts_wq: ExpertsWq | None = None
        self.scratch: DequantScratch | None = None
        # W8A8 int8 experts (layers/moe/int8_experts.py): made from the fp32 ones by --quantization
        # w8a8_int8, or a compressed-tensors checkpoint's own (model_loader/quantized_experts.py).
        self.experts_int8: ExpertsInt8 | None = None

    def attach_quantized(self, form: ExpertsWq, scratch: DequantScratch) -> None:
        """Serve the local experts from `form` only (its dequantization must equal the fp32
        weights, checked by the caller): the fp32 stacked weights are freed, their shapes kept."""
        self.experts_wq, self.scratch = form, scratch
        for param in (self.w13_weight, self.w2_weight):
            replace_storage(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))

    def allocate_fp32(self, device: torch.device) -> None:
        """Give weights built on the meta device (`experts_on_meta`) uninitialised storage on
        `device` for a loader to fill."""
        for param in (self.w13_weight, self.w2_weight):
            if param.is_meta:
                replace_storage(param, torch.empty(param.shape, dtype=param.dtype, device=device))

    def detach_quantized(self) -> None:
        """Serve the fp32 weights again (they changed: the form no longer describes them)."""
        self.materialize_fp32()
        self.experts_wq = None

    @property
    def fp32_dropped(self) -> bool:
        return self.w13_weight.is_meta

    def materialize_fp32(self) -> None:
        """Bring the dropped fp32 weights back as the quantized forms' dequantization (a weight
        update writes into them; attaching the forms again drops them)."""
        if not self.fp32_dropped:
            return
        assert self.experts_wq is not None
        w13, w2 = self.experts_wq.dequantize()
        replace_storage(self.w13_weight, w13.to(self.w13_weight.dtype))
        replace_storage(self.w2_weight, w2.to(self.w2_weight.dtype))

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [num_tokens, hidden_size], topk_* [num_tokens, top_k] -> [num_tokens, hidden_size]."""
        start = self.expert_start if self.ep_size > 1 else None
        if hidden.is_cuda and start is None and self.experts_wq is None and self.experts_int8 is None:
            # The grouped path loops over experts on the host (a sync per step, no CUDA graph);
            # the Triton kernels launch a fixed grid whatever the routing.
            from radixserve.layers.moe.fused_moe_triton import fused_experts_triton

            out = fused_experts_triton(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        elif (
            on_panels := experts_on_panels(hidden, topk_weights, topk_ids, start, self.experts_wq)
        ) is not None:
            out = on_panels  # decode-sized batches on the stacked int8-activation panels, one call
        else:
            out = fused_experts_grouped(
                hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                start, self.experts_wq, self.scratch, self.experts_int8,
            )  # fmt: skip
        if self.tp.size > 1:
            self.tp.all_reduce_(out)
        return out

    def checkpoint_piece(
        self, name: str, param: torch.Tensor
    ) -> tuple[torch.Tensor | None, tuple[int, int], int, int]:
        """Where this rank's part of per-expert checkpoint tensor `name` lies in `param`:
        (the slot in param, None for an expert another rank holds; the full checkpoint tensor's
        shape; the dim it is split along; this rank's start on it). Loading copies into the slot;
        /get_weights_by_name reads it back."""
        match = EXPERT_WEIGHT.search(name)
        if match is None:
            raise ModelLoadError(f"{name}: not a per-expert weight (experts.<id>.<proj>.weight)")
        expert, proj = int(match.group(1)), match.group(2)
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"{name}: expert {expert} of a layer with {self.num_experts}")
        local = expert - self.expert_start
        here = 0 <= local < self.num_local
        if param.is_meta and here:  # dropped fp32 (a read: loading materializes first)
            assert self.experts_wq is not None
            param = (self.experts_wq.w2 if proj in _DOWN else self.experts_wq.w13)[local].dequantize()
            param = param.unsqueeze(0)
            local = 0
        full_inter, start = self.inter * (self.tp.size // self.ep_size), self.moe_tp_rank * self.inter
        if proj in _DOWN:  # [hidden, inter]: a rank holds a block of its columns
            return (param[local] if here else None), (param.shape[1], full_inter), 1, start
        offset = 0 if proj in _GATE else self.inter  # gate rows, then up rows
        slot = param[local, offset : offset + self.inter] if here else None
        return slot, (full_inter, param.shape[-1]), 0, start

    def load_stacked(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """Every expert's projection in one checkpoint tensor (Qwen3-VL-MoE's `experts.gate_up_proj`
        [E, 2 * inter, hidden] and `experts.down_proj` [E, hidden, inter], transformers 5's layout,
        or the original release's [E, hidden, 2 * inter] / [E, inter, hidden]). transformers' rule
        decides between them: the parameter's own layout when the shape is it, else transposed.
        Reads only this rank's experts."""
        self.materialize_fp32()
        is_up = param is self.w13_weight
        full_inter, start = self.inter * (self.tp.size // self.ep_size), self.moe_tp_rank * self.inter
        hidden = param.shape[1] if not is_up else param.shape[2]
        ours = (self.num_experts, 2 * full_inter, hidden) if is_up else (self.num_experts, hidden, full_inter)
        theirs = (ours[0], ours[2], ours[1])
        if tuple(loaded.shape) not in (ours, theirs):
            raise ModelLoadError(
                f"Shape mismatch for {loaded.name}: the config implies {ours} (or {theirs}), the "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        data = loaded.narrow(0, self.expert_start, self.num_local)
        if tuple(loaded.shape) != ours:
            data = data.transpose(1, 2)
        if is_up:  # gate rows then up rows, this rank's block of each
            up = full_inter + start
            data = torch.cat([data[:, start : start + self.inter], data[:, up : up + self.inter]], dim=1)
        else:
            data = data[:, :, start : start + self.inter]
        param.data.copy_(data.to(param.dtype))

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        self.materialize_fp32()
        slot, full_shape, dim, start = self.checkpoint_piece(loaded.name, param.data)
        if slot is None:
            return  # another rank's expert
        if tuple(loaded.shape) != full_shape:
            raise ModelLoadError(
                f"Shape mismatch for {loaded.name}: the config implies {full_shape}, the checkpoint "
                f"has {tuple(loaded.shape)}"
            )
        slot.copy_(loaded.narrow(dim, start, slot.shape[dim]))
