"""MoE layers in the CPU fused decode (cpu_decode_runner.py): each SparseMoeBlock handed to the
compiled stack as one MoE MLP (sgl-kernel's csrc/cpu/decode_moe.h), so a MoE model's decode step
at one to a few tokens is one call, as a dense model's is.

The stack runs the block as the module forward does (models/moe_decoder.py): the router linear,
softmax top-k with or without renormalisation (layers/moe/topk.py), the routed experts through
moe_wq_a8_packed on their stacked int8-activation panels (layers/moe/fused_moe_a8.py), and the
shared expert (the layer's dense MLP slot, the same small-M linears a dense layer's MLP runs) with
its sigmoid gate. Same ops, same kernels: the same bits (test/engine/test_cpu_decode_moe.py).

Only experts served from their panels (Crossovers.moe_a8: the tuning's choice or
--cpu-wq-int8-activations) are taken: the exact grouped path (fp32 activations over the forms) has
no compiled counterpart here, so such a model keeps the module forward. Also refused: expert
parallelism and tensor parallelism (the block's all-reduce), an active expert-distribution
recorder (it counts the router's choices in Python), LoRA on a MoE model.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.layers.cpu_fused import cpu_kernels
from radixserve.layers.moe import fused_moe_a8
from radixserve.layers.moe.layer import FusedMoE
from radixserve.models.moe_decoder import SparseMoeBlock


def dense_mlp(layer: torch.nn.Module) -> Any:  # noqa: ANN401 - LlamaMLP or None
    """The dense MLP whose gate_up_proj / down_proj the stack's MLP slot runs: the layer's own,
    a MoE layer's shared expert, or None (a MoE layer without one)."""
    mlp = layer.mlp
    return mlp.shared_expert if isinstance(mlp, SparseMoeBlock) else mlp


def moe_blocks(layers: list[torch.nn.Module]) -> list[SparseMoeBlock]:
    # getattr: a pipeline stage holds placeholders (MissingLayer) for the other stages' layers.
    return [m for m in (getattr(layer, "mlp", None) for layer in layers) if isinstance(m, SparseMoeBlock)]


def why_not_fused(blocks: list[SparseMoeBlock], lora: object | None) -> str | None:
    """Why the stack cannot run these MoE blocks as the module forward does, or None."""
    if not blocks:
        return None
    decode_model_cls = getattr(getattr(cpu_kernels, "_ext", None), "DecodeModel", None)
    if not hasattr(decode_model_cls, "set_layer_moe"):
        return "MoE layers (this sgl-kernel build has no compiled MoE block: rebuild sgl-kernel)"
    if lora is not None:
        return "MoE layers with LoRA"
    for block in blocks:
        experts: FusedMoE = block.experts
        wq = experts.experts_wq
        if wq is None or wq.w13_panels is None or not fused_moe_a8.MOE_A8_KERNEL:
            return "MoE layers whose experts do not serve from their int8-activation panels"
        if experts.tp.size > 1 or experts.ep_size > 1:
            return "MoE layers under tensor or expert parallelism"
        if block.expert_recorder is not None:
            return "MoE layers with the expert-distribution recorder"
    return None


def _experts_tuple(panels: Any) -> tuple:  # noqa: ANN401 - WqA8PackedExperts
    return (panels.q, panels.scales, panels.offsets, panels.bits, panels.group_size, panels.zero_point)


def empty_mlp_weights(hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP slot's weights of a MoE layer without a shared expert: [0, hidden] and [hidden, 0]."""
    return torch.empty(0, hidden_size), torch.empty(hidden_size, 0)


def set_layer_moe(decode_model: Any, layer_id: int, block: SparseMoeBlock) -> None:  # noqa: ANN401
    """Give layer `layer_id` of the stack `block` as its MLP (its MLP slot holds the shared
    expert already, or nothing)."""
    wq = block.experts.experts_wq
    gate = block.shared_expert_gate
    decode_model.set_layer_moe(
        layer_id,
        block.gate.weight.detach().contiguous(),
        block.top_k,
        block.renormalize,
        _experts_tuple(wq.w13_panels),
        _experts_tuple(wq.w2_panels),
        block.shared_expert is not None,
        None if gate is None else gate.weight.detach().contiguous(),
    )
