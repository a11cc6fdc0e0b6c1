"""Activations on fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.layers.cpu_fused import cpu_kernels, fusable


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up, as MergedColumnLinear stacks them) -> [..., d]."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and fusable(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    return silu_and_mul_native(gate_up)


def silu_and_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch reference of silu_and_mul."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]
