"""Quantized experts in one compiled call (sgl-kernel's moe_wq_a8_packed), decode steps and
prefills alike.

Under --cpu-wq-int8-activations a MoE layer's expert forms carry their int8-activation panels
stacked per projection (layers/moe/quantized.py's mark_int8_activations). Every expert group of
any batch reads those panels anyway (fused_moe_cpu.py's grouped path; group_quant.wq_rows_bound),
so the kernel runs the whole layer's experts at once: x quantized once, the pairs sorted in C++, one parallel region per
projection over every routed expert's panels. Its numbers are the grouped path's bit for bit
(test/kernels/test_moe_wq_a8_packed.py); what it saves is the per-expert Python loop and the small
calls (docs/benchmarks.md, the MoE section).
"""

from __future__ import annotations

import torch

from radixserve.layers import group_quant
from radixserve.layers.moe.quantized import ExpertsWq

# sgl-kernel's moe_wq_a8_packed is built (an older build runs the grouped path).
MOE_A8_KERNEL = group_quant.WQ_A8_PACKED and group_quant.cpu_kernels.moe_wq_a8_packed_available()


def experts_on_panels(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] the layer's expert ids
    expert_start: int | None,  # this rank's first expert under expert parallelism, else None
    wq: ExpertsWq | None,
) -> torch.Tensor | None:
    """The routed experts' combined output [num_tokens, hidden_size] from moe_wq_a8_packed, or
    None where the grouped path must run: no stacked panels, not fp32 on the CPU, no tokens, or the kernel not built (group_quant.WQ_A8_KERNEL read at call time, so
    tests can force the torch reference)."""
    if (
        wq is None
        or wq.w13_panels is None
        or not (MOE_A8_KERNEL and group_quant.WQ_A8_KERNEL)
        or hidden.device.type != "cpu"
        or hidden.dtype != torch.float32
        or hidden.dim() != 2
        or hidden.shape[0] == 0
    ):
        return None
    ids = topk_ids if expert_start is None else topk_ids - expert_start  # local ids; others skipped
    return group_quant.cpu_kernels.moe_wq_a8_packed(
        hidden.contiguous(),
        ids.to(torch.int64).contiguous(),
        topk_weights.to(torch.float32).contiguous(),
        wq.w13_panels,
        wq.w2_panels,
    )
