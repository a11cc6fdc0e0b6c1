"""Paged attention in plain torch: the reference every other backend is tested against.

Requests are padded into one batched SDPA call per layer (not one call per request): the KV of
request b is gathered from the pool through `req_to_token[req_pool_idx_b, :seq_len_b]`, and a
boolean mask hides padding and, for extend, future tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


@dataclass
class TorchNativeMetadata:
    kv_indices: torch.Tensor  # [bs, max_seq_len] int64 pool slots (padding -> slot 0)
    attn_mask: torch.Tensor  # [bs, 1, max_q_len, max_seq_len] bool, True = attend
    # Extend only: where each of the step's tokens sits in the padded [bs * max_q_len] query grid.
    q_scatter_index: torch.Tensor | None
    max_q_len: int


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        seq_lens = forward_batch.seq_lens  # [bs]
        bs = forward_batch.batch_size
        max_seq_len = max(forward_batch.seq_lens_cpu) if bs else 0
        key_pos = torch.arange(max_seq_len, device=self.device)  # [max_seq_len]
        valid_key = key_pos[None, :] < seq_lens[:, None]  # [bs, max_seq_len]
        rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :max_seq_len]
        kv_indices = torch.where(
            valid_key, rows.long(), torch.zeros_like(rows, dtype=torch.long)
        ).contiguous()

        if forward_batch.forward_mode.is_decode():
            mask = valid_key[:, None, None, :]  # [bs, 1, 1, max_seq_len]
            forward_batch.attn_metadata = TorchNativeMetadata(kv_indices, mask, None, 1)
            return

        extend_lens_cpu = forward_batch.extend_seq_lens_cpu
        assert extend_lens_cpu is not None
        max_q_len = max(extend_lens_cpu)
        extend_lens = torch.tensor(extend_lens_cpu, device=self.device)  # [bs]
        prefix_lens = seq_lens - extend_lens  # [bs]
        q_pos = torch.arange(max_q_len, device=self.device)  # [max_q_len]
        # Query i of request b sits at absolute position prefix_len_b + i and sees keys <= it.
        abs_q = prefix_lens[:, None] + q_pos[None, :]  # [bs, max_q_len]
        causal = key_pos[None, None, :] <= abs_q[:, :, None]  # [bs, max_q_len, max_seq_len]
        mask = causal & valid_key[:, None, :]
        # Padded query rows would be all-masked (NaN in SDPA): let them see key 0, then drop them.
        pad_q = q_pos[None, :] >= extend_lens[:, None]  # [bs, max_q_len]
        mask[..., 0] |= pad_q
        starts = torch.arange(bs, device=self.device) * max_q_len  # [bs]
        token_req = torch.repeat_interleave(torch.arange(bs, device=self.device), extend_lens)
        token_off = torch.arange(int(extend_lens.sum()), device=self.device) - torch.repeat_interleave(
            torch.cumsum(extend_lens, 0) - extend_lens, extend_lens
        )
        q_scatter_index = starts[token_req] + token_off  # [num_tokens]
        forward_batch.attn_metadata = TorchNativeMetadata(
            kv_indices, mask[:, None], q_scatter_index, max_q_len
        )

    def _gather_kv(
        self, layer: RadixAttention, forward_batch: ForwardBatch, meta: TorchNativeMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = forward_batch.token_to_kv_pool
        bs, max_seq_len = meta.kv_indices.shape
        flat = meta.kv_indices.view(-1)  # index_select is a plain row copy, cheaper than fancy indexing
        shape = (bs, max_seq_len, layer.num_kv_heads, layer.head_dim)
        # [bs, num_kv_heads, max_seq_len, head_dim]
        k = pool.get_key_buffer(layer.layer_id).index_select(0, flat).view(shape).transpose(1, 2)
        v = pool.get_value_buffer(layer.layer_id).index_select(0, flat).view(shape).transpose(1, 2)
        return k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: RadixAttention
    ) -> torch.Tensor:
        """q [bs, num_heads, q_len, head_dim]; k, v [bs, num_kv_heads, kv_len, head_dim]."""
        # enable_gqa lets query-head groups share a KV head without materializing repeated K/V.
        out = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
        )
        return out  # [bs, num_heads, q_len, head_dim]

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: TorchNativeMetadata = forward_batch.attn_metadata
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_all, v_all = self._gather_kv(layer, forward_batch, meta)
        bs, num_tokens = forward_batch.batch_size, q.shape[0]
        q_pad = q.new_zeros(bs * meta.max_q_len, layer.num_heads, layer.head_dim)
        q_pad[meta.q_scatter_index] = q
        q_pad = q_pad.view(bs, meta.max_q_len, layer.num_heads, layer.head_dim).transpose(1, 2)
        out = self._attend(q_pad, k_all, v_all, meta.attn_mask, layer)  # [bs, H, max_q_len, D]
        out = out.transpose(1, 2).reshape(bs * meta.max_q_len, layer.num_heads * layer.head_dim)
        return out[meta.q_scatter_index] if num_tokens != out.shape[0] else out

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: TorchNativeMetadata = forward_batch.attn_metadata
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_all, v_all = self._gather_kv(layer, forward_batch, meta)
        out = self._attend(q.unsqueeze(2), k_all, v_all, meta.attn_mask, layer)  # [bs, H, 1, D]
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)
