"""RMSNorm, with the fused residual-add variant the decoder layers use."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x; with `residual`, first add it and also return the sum (the new residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # Normalize in fp32 whatever the storage dtype, as HF does, for parity.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        out = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)
