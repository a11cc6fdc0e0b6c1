"""Activations on fused projections, and the activations a linear may apply in its epilogue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.layers.cpu_fused import cpu_kernels, fusable
from radixserve.layers.gpu_fused import triton_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up, as MergedColumnLinear stacks them) -> [..., d]."""
    if (ops := triton_ops(gate_up)) is not None:
        return ops.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and fusable(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    return silu_and_mul_native(gate_up)


def silu_and_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch reference of silu_and_mul."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


@dataclass(frozen=True)
class Activation:
    """An elementwise activation, as torch computes it and as oneDNN's GEMM epilogue does
    (Linear.forward_act): the post-op name and algorithm of torch.ops.mkldnn._linear_pointwise."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    onednn: tuple[str, str]


# HF's `hidden_act` names (BERT, XLM-R).
ACTIVATIONS: dict[str, Activation] = {
    "gelu": Activation(F.gelu, ("gelu", "none")),  # erf GELU
    "gelu_new": Activation(lambda x: F.gelu(x, approximate="tanh"), ("gelu", "tanh")),
    "gelu_pytorch_tanh": Activation(lambda x: F.gelu(x, approximate="tanh"), ("gelu", "tanh")),
    "relu": Activation(F.relu, ("relu", "")),
}
