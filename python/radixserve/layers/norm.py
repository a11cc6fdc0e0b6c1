"""RMSNorm, with the fused residual-add variant the decoder layers use."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.cpu_fused import cpu_kernels, fusable
from radixserve.layers.gpu_fused import triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x; with `residual`, first add it and also return the sum (the new residual).

        On the compiled CPU path the residual form works in place: `residual` becomes the sum and
        `x` the normalized output (both are the layer's own intermediates, never reused)."""
        if (ops := triton_ops(x)) is not None:
            return ops.rmsnorm(x, self.weight, self.variance_epsilon, residual)
        if x.dim() == 2 and x.stride(-1) == 1 and fusable(x, self.weight):
            if residual is None:
                return cpu_kernels.rmsnorm(x, self.weight, self.variance_epsilon)
            if residual.stride(-1) == 1 and fusable(residual):
                cpu_kernels.fused_add_rmsnorm_(x, residual, self.weight, self.variance_epsilon)
                return x, residual
        if x.dim() > 2 and residual is None and x.stride(-1) == 1 and fusable(x, self.weight):
            # Per-head norms (Qwen3's q/k norms, x [tokens, heads, head_dim] views of qkv): one
            # compiled call over the heads' rows, not the reference's seven torch ops (8 norms a
            # layer-pair of a one-token MoE step, where per-op Python is a quarter of the step).
            rows = x.reshape(-1, x.shape[-1])  # a view at one token, a copy of q or k above
            return cpu_kernels.rmsnorm(rows, self.weight, self.variance_epsilon).view(x.shape)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch reference (any device and dtype); never modifies its inputs."""
        if residual is not None:
            x = x + residual
            residual = x
        # Normalize in fp32 whatever the storage dtype, as HF does, for parity.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        out = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)
