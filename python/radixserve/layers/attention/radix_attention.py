"""The attention layer models call: holds the layer's shape and defers the math to the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
