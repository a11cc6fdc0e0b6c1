"""Linear layers with sgl-kernel's small-batch CPU paths, optionally over an fp16 weight copy.

torch's fp32 GEMM (MKL) reads weights at ~15 GB/s for a single token and slower for 2-16 tokens
on this CPU; sgl-kernel's register-tiled kernel streams them at ~27 GB/s, so decode batches up to
SMALL_BATCH_MAX_TOKENS tokens use it (no change in precision, only in summation order).

A decode step of a few requests is bound by reading the weights, not by arithmetic: at batch 1
the built-in model's fp32 weights (~0.54 GB) take ~25 ms per step at this machine's ~20 GB/s.
With `--cpu-fp16-weights` every Linear (and the LM head) also keeps its weight in fp16, and
batches of at most SMALL_BATCH_MAX_TOKENS tokens go through sgl-kernel's `linear_f16` (F16C
conversion, fp32 math), reading half the bytes. Larger batches are compute-bound and keep the
fp32 GEMM. The price is 50% more weight memory and fp16 rounding of the weights (outputs then
differ slightly from fp32, which is why it is opt-in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_fused
from radixserve.layers.cpu_fused import cpu_kernels, fusable

# Up to this many tokens sgl-kernel's small-M kernels beat torch's fp32 GEMM on this 2-core AVX2
# CPU (1.9x at 1 token, 1.2x at 32, even at 64: docs/benchmarks.md); beyond, the GEMM wins.
SMALL_BATCH_MAX_TOKENS = 32


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_f16: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T (+ bias). Small fp32 CPU batches go through sgl-kernel: the
    fp16 weight copy when there is one, else the fp32 weight (both with fp32 math)."""
    if x.dim() == 2 and x.shape[0] <= SMALL_BATCH_MAX_TOKENS and x.stride(-1) == 1 and fusable(x):
        if weight_f16 is not None:
            return cpu_kernels.linear_f16(x, weight_f16, bias)
        if fusable(weight):
            return cpu_kernels.linear_f32(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) with an optional fp16 weight copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.weight_f16: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_f16)


def fp16_copy(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().to(torch.float16).contiguous()


def attach_fp16_weights(model: nn.Module) -> int:
    """Give every Linear of `model` its fp16 weight copy; returns the bytes added."""
    if not cpu_fused.ENABLED:
        raise RuntimeError(
            "--cpu-fp16-weights needs sgl-kernel's compiled CPU extension "
            "(`pip install --no-build-isolation -e sgl-kernel`, which make setup runs)"
        )
    added = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.float32:
            module.weight_f16 = fp16_copy(module.weight)
            added += module.weight_f16.numel() * 2
    return added
