"""Paged attention in plain torch: the reference every other backend is tested against.

The KV of request b is gathered from the pool through `req_to_token[req_pool_idx_b, :seq_len_b]`.
Decode pads the batch into one SDPA call per layer (one query each, a mask hides the padding).
Extend runs one SDPA call per request: requests in a prefill batch are ragged (a 1088-token
prompt beside 64-token questions over a cached prefix), and padding every request to the longest
one multiplied the attention work by up to the batch size. A request without a cached prefix uses
SDPA's causal mode (its kernel skips the upper triangle); one with a prefix gets an explicit mask
(query i sees keys up to prefix_len + i). Encoder models (ForwardBatch.attn_causal False) attend
bidirectionally: no mask at all, every query sees every key of its request. A speculative draft
tree (ForwardBatch.spec_tree_mask) gets the explicit mask too: the whole prefix, then each row's
ancestors and itself among the new rows.
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
class ExtendSegment:
    """One request of an extend batch: its rows of the step's tokens and its KV slots."""

    q_start: int  # first row of this request in q / the output
    q_len: int  # extend_len
    kv_indices: torch.Tensor  # [seq_len] int64 pool slots (prefix + new tokens)
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend) with a prefix; None: see causal
    causal: bool = True  # with no mask: causal (decoders) or full (encoders)


@dataclass
class TorchNativeMetadata:
    # Decode: [bs, max_seq_len] slots (padding -> slot 0) and [bs, 1, 1, max_seq_len] mask.
    kv_indices: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    segments: list[ExtendSegment] | None = None  # extend only


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            forward_batch.attn_metadata = self._decode_metadata(forward_batch)
        else:
            forward_batch.attn_metadata = TorchNativeMetadata(segments=self._extend_segments(forward_batch))

    def _decode_metadata(self, forward_batch: ForwardBatch) -> TorchNativeMetadata:
        seq_lens = forward_batch.seq_lens  # [bs]
        max_seq_len = max(forward_batch.seq_lens_cpu) if forward_batch.batch_size else 0
        key_pos = torch.arange(max_seq_len, device=self.device)  # [max_seq_len]
        valid_key = key_pos[None, :] < seq_lens[:, None]  # [bs, max_seq_len]
        rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :max_seq_len]
        kv_indices = torch.where(valid_key, rows.long(), torch.zeros_like(rows, dtype=torch.long))
        return TorchNativeMetadata(kv_indices.contiguous(), valid_key[:, None, None, :])

    def _extend_segments(self, forward_batch: ForwardBatch) -> list[ExtendSegment]:
        extend_lens = forward_batch.extend_seq_lens_cpu
        assert extend_lens is not None
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        tree = forward_batch.spec_tree_mask
        segments, q_start, tree_at = [], 0, 0
        for row, seq_len, q_len in zip(rows, forward_batch.seq_lens_cpu, extend_lens):
            prefix_len = seq_len - q_len
            mask = None
            if tree is not None:  # a draft tree: the whole prefix, then ancestors and itself
                among_new = (
                    tree[tree_at : tree_at + q_len * q_len].view(q_len, q_len).to(self.device, torch.bool)
                )
                full = torch.ones(q_len, prefix_len, dtype=torch.bool, device=self.device)
                mask = torch.cat([full, among_new], dim=1)  # [q_len, seq_len]
                tree_at += q_len * q_len
            elif prefix_len > 0 and forward_batch.attn_causal:
                q_pos = torch.arange(prefix_len, seq_len, device=self.device)  # [q_len]
                mask = torch.arange(seq_len, device=self.device)[None, :] <= q_pos[:, None]
            kv_indices = req_to_token[row, :seq_len].long()  # [seq_len]
            segments.append(ExtendSegment(q_start, q_len, kv_indices, mask, forward_batch.attn_causal))
            q_start += q_len
        return segments

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        layer: RadixAttention,
        causal: bool = True,
    ) -> torch.Tensor:
        """q [bs, num_heads, q_len, head_dim]; k, v [bs, num_kv_heads, kv_len, head_dim];
        mask None means causal with q_len == kv_len (or, with causal False, no mask at all)."""
        # enable_gqa lets query-head groups share a KV head without materializing repeated K/V.
        out = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask,
            is_causal=mask is None and causal,
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
        assert meta.segments is not None
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)  # [num_tokens, H * D]
        for seg in meta.segments:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            q_b = q[rows].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
            # [seq_len, Hkv, D] each, dequantized from the pool's storage dtype
            k_rows, v_rows = pool.read_kv(layer.layer_id, seg.kv_indices, q.dtype)
            k_b = k_rows.transpose(0, 1)[None]  # [1, Hkv, seq_len, D]
            v_b = v_rows.transpose(0, 1)[None]
            o_b = self._attend(q_b, k_b, v_b, seg.mask, layer, seg.causal)  # [1, H, q_len, D]
            out[rows] = o_b[0].transpose(0, 1).reshape(seg.q_len, -1)
        return out

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: TorchNativeMetadata = forward_batch.attn_metadata
        assert meta.kv_indices is not None and meta.attn_mask is not None
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        pool = forward_batch.token_to_kv_pool
        bs, max_seq_len = meta.kv_indices.shape
        flat = meta.kv_indices.view(-1)  # index_select is a plain row copy, cheaper than fancy indexing
        shape = (bs, max_seq_len, layer.num_kv_heads, layer.head_dim)
        k_rows, v_rows = pool.read_kv(layer.layer_id, flat, q.dtype)  # [bs * max_seq_len, Hkv, D]
        k_all = k_rows.view(shape).transpose(1, 2)  # [bs, num_kv_heads, max_seq_len, head_dim]
        v_all = v_rows.view(shape).transpose(1, 2)
        out = self._attend(q.unsqueeze(2), k_all, v_all, meta.attn_mask, layer)  # [bs, H, 1, D]
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)
