"""The attention-backend interface shared by torch_native (the oracle), triton and flashinfer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes paged attention over ReqToTokenPool / TokenToKVPool.

    `init_forward_metadata` runs once per step and precomputes whatever the kernels need (KV
    gather indices, masks, kernel plans), so the per-layer calls do only the math. Before the
    math, each call writes this step's K/V into the pool at `forward_batch.out_cache_loc`.
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare per-step metadata, stored on `forward_batch.attn_metadata`."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Causal attention of new tokens over their request's cached prefix and each other.
        Returns [num_tokens, num_heads * head_dim]."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,  # [bs, num_heads, head_dim]
        k: torch.Tensor,  # [bs, num_kv_heads, head_dim]
        v: torch.Tensor,  # [bs, num_kv_heads, head_dim]
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """One new token per request over its whole sequence. Returns [bs, num_heads * head_dim]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)
