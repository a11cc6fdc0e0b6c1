"""The attention-backend interface shared by torch_native (the oracle), triton and flashinfer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
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


class CudaGraphAttnBackend(AttentionBackend):
    """An attention backend whose decode kernels can be captured in CUDA graphs (triton, flashinfer).

    Decode only: a graph replays the kernels it captured with the same pointers, so the per-step metadata must
    live in fixed-size buffers that the replay hook rewrites in place, outside the graph. Nothing
    the captured kernels read may be allocated per step, and nothing inside them may read values
    back to the host (.item(), .tolist(), data-dependent shapes).
    """

    @abstractmethod
    def init_cuda_graph_state(
        self, max_bs: int, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool
    ) -> None:
        """Allocate the fixed buffers shared by every captured batch size (<= max_bs rows, each
        reading at most req_to_token_pool.max_context_len KV slots) and keep the pools the replay
        hook reads."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,  # [bs] int64, a view of the graph's static buffer
        seq_lens: torch.Tensor,  # [bs] int64, a view of the graph's static buffer
    ) -> Any:  # noqa: ANN401 - each backend's own metadata type, stored on ForwardBatch.attn_metadata
        """Metadata for the graph of batch size `bs`, built on the fixed buffers: the captured
        kernels keep reading these tensors at every replay."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,  # [bs] int64 on device (padding rows included)
        seq_lens: torch.Tensor,  # [bs] int64 on device (padding rows included)
        seq_lens_cpu: list[int],  # [bs] the same lengths on the host
        metadata: Any,  # noqa: ANN401 - what the capture hook returned for this bs
    ) -> None:
        """Rewrite the fixed buffers for this step's batch, before the graph of size `bs` replays.
        Runs eagerly (outside the graph), so it may use host values such as seq_lens_cpu."""
