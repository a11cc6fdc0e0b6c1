"""Bidirectional attention of encoder prefills (BERT-style) straight from the step's K/V.

An encoder request never has a cached prefix (its KV depends on every token of the input, so none
is shared) and is never chunked: the K/V a paged read would gather back from the pool for it are
exactly this step's k and v, and nothing reads them later. The cpu backend therefore attends them
in place, skipping the pool write and the per-layer gather; the torch-native backend (the
reference) keeps the paged path, and the tests compare the two.

Requests of equal length (the usual embedding batch) run as one SDPA call over a [bs, heads, len,
head_dim] view; ragged batches run one call per request.

When the pooling reads one row per request (CLS), the last layer needs the attention output of
that row only: `pooled_row_attention` attends one query per request over the request's K/V. With
no causal mask and no positional term in the scores, a query's output depends on nothing but
its own q and the request's K/V, so this is exactly that row of the full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class EncoderMetadata:
    """A bidirectional prefill with no cached prefix: attention over the step's own K/V."""

    extend_lens: list[int]


def attends_own_kv(forward_batch: ForwardBatch) -> bool:
    """Whether this step's attention reads the step's own K/V in place (the cpu backend on an
    encoder prefill): then a layer may attend a subset of the queries (pooled_row_attention)."""
    return isinstance(forward_batch.attn_metadata, EncoderMetadata)


def pooled_row_attention(
    q: torch.Tensor,  # [bs, num_heads, head_dim]: one query per request
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    extend_lens: list[int],
    layer: RadixAttention,
) -> torch.Tensor:
    """[bs, num_heads * head_dim]: request b's query attends to every token of request b."""
    return _attend_per_request(q, k, v, [1] * len(extend_lens), extend_lens, layer)


def bidirectional_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    extend_lens: list[int],
    layer: RadixAttention,
) -> torch.Tensor:
    """[num_tokens, num_heads * head_dim]: every token attends to every token of its request."""
    return _attend_per_request(q, k, v, extend_lens, extend_lens, layer)


def _attend_per_request(
    q: torch.Tensor,  # [sum(q_lens), num_heads, head_dim]
    k: torch.Tensor,  # [sum(kv_lens), num_kv_heads, head_dim]
    v: torch.Tensor,  # [sum(kv_lens), num_kv_heads, head_dim]
    q_lens: list[int],
    kv_lens: list[int],
    layer: RadixAttention,
) -> torch.Tensor:
    """[sum(q_lens), num_heads * head_dim]: request b's q_lens[b] queries attend, unmasked, to its
    kv_lens[b] keys. Equal lengths: one SDPA call over a [bs, heads, len, head_dim] view."""
    bs, gqa = len(kv_lens), layer.num_kv_heads != layer.num_heads
    if len(set(q_lens)) == 1 and len(set(kv_lens)) == 1:
        q_len, seq = q_lens[0], kv_lens[0]
        out = F.scaled_dot_product_attention(
            q.view(bs, q_len, layer.num_heads, layer.head_dim).transpose(1, 2),
            k.view(bs, seq, layer.num_kv_heads, layer.head_dim).transpose(1, 2),
            v.view(bs, seq, layer.num_kv_heads, layer.head_dim).transpose(1, 2),
            scale=layer.scaling,
            enable_gqa=gqa,
        )  # [bs, num_heads, q_len, head_dim]
        return out.transpose(1, 2).reshape(bs * q_len, layer.num_heads * layer.head_dim)
    out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        q_rows, kv_rows = slice(q_start, q_start + q_len), slice(kv_start, kv_start + kv_len)
        o = F.scaled_dot_product_attention(
            q[q_rows].transpose(0, 1)[None],
            k[kv_rows].transpose(0, 1)[None],
            v[kv_rows].transpose(0, 1)[None],
            scale=layer.scaling,
            enable_gqa=gqa,
        )  # [1, num_heads, q_len, head_dim]
        out[q_rows] = o[0].transpose(0, 1).reshape(q_len, -1)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return out
