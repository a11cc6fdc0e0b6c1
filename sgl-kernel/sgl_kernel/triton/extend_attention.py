"""Paged extend (prefill) attention: new tokens attend to their request's cached prefix, read
from the KV pool through kv_indices, and causally to each other.

The two parts are separate loops in one kernel, sharing one online softmax:
  1. prefix: slots kv_indices[kv_indptr[b]:kv_indptr[b+1]] — gathered rows, no mask (every new
     token sees the whole prefix);
  2. new tokens: contiguous rows of this step's K/V (qo_indptr ragged layout) — coalesced loads,
     causal mask, and the loop stops at the query block's diagonal, so the upper triangle is
     never read.
Splitting them keeps the common case (long prefix from the radix cache) free of per-element
causal masking, and reads the new tokens without an index gather.

A speculative draft tree (optional `tree_mask`) replaces the causal mask among the new tokens:
per request an [e, e] row-major uint8 mask (1 = attend; row i sees its ancestors and itself),
flattened and concatenated over the batch, the layout the compiled CPU kernel and torch-native
take. The prefix part is unchanged (a tree's rows all see the whole prefix). Rows list parents
before children, so the mask is lower-triangular and the loop still stops at the diagonal; it is
ANDed with causal so an entry above the diagonal can never leak a later row in.

The new tokens' K/V are rounded through the pool dtype before use, so results equal reading them
back from the pool (which the kernel's caller has already written via kv_store).
"""

# Triton parses @triton.jit parameter annotations (tl.constexpr, dtype hints), so kernel
# arguments stay unannotated; every host-side function is fully typed.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.triton._common import (
    dot_precision,
    last_dim_contiguous,
    next_pow2,
    on_interpreter,
    online_softmax_update,
)
from sgl_kernel.triton.decode_attention import LOG2E


@triton.jit
def _extend_kernel(
    Q,  # [N, H, D] new tokens' queries, requests concatenated
    K_Ext,  # [N, Hkv, D] new tokens' keys
    V_Ext,  # [N, Hkv, D]
    Out,  # [N, H, D]
    K_Buf,  # [S, Hkv, D] pool
    V_Buf,  # [S, Hkv, D]
    Qo_Indptr,  # [bs + 1] int32 offsets of each request's new tokens
    Kv_Indptr,  # [bs + 1] int32 offsets of each request's prefix slots
    Kv_Indices,  # [total_prefix] int32
    Tree_Mask,  # [sum e_b^2] uint8 draft-tree masks among the new tokens (USE_TREE_MASK only)
    Mask_Indptr,  # [bs + 1] int32 offsets of each request's [e_b, e_b] mask in Tree_Mask
    qk_scale,  # sm_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    kv_group_num: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TREE_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_blk = tl.program_id(2)
    kv_head = h // kv_group_num

    q_start = tl.load(Qo_Indptr + b)
    ext_len = tl.load(Qo_Indptr + b + 1) - q_start
    # The grid is sized by the longest request; shorter ones have nothing in this block.
    if m_blk * BLOCK_M < ext_len:
        pre_start = tl.load(Kv_Indptr + b)
        pre_len = tl.load(Kv_Indptr + b + 1) - pre_start
        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # token offset within the request
        m_mask = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1. cached prefix, gathered from the pool; all of it is visible to every new token.
        for start in range(0, pre_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < pre_len
            slots = tl.load(Kv_Indices + pre_start + offs_n, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                K_Buf + slots[:, None] * stride_kbt + kv_head * stride_kbh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            v = tl.load(
                V_Buf + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = v.to(q.dtype)
            m_i, l_i, acc = online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION)

        # 2. this step's tokens, causal; nothing past the block's last query row is needed.
        # Column 0 is visible to every row (a tree's root too), so m_i is finite before any
        # fully masked tile.
        if USE_TREE_MASK:
            mask_start = tl.load(Mask_Indptr + b).to(tl.int64)
        causal_end = tl.minimum((m_blk + 1) * BLOCK_M, ext_len)
        for start in range(0, causal_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < ext_len
            kv_rows = (q_start + offs_n).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                K_Ext + kv_rows[:, None] * stride_ket + kv_head * stride_keh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            k = k.to(K_Buf.dtype.element_ty).to(q.dtype)  # round like the pool copy
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = (offs_n[None, :] <= offs_m[:, None]) & n_mask[None, :]
            if USE_TREE_MASK:
                tree = tl.load(
                    Tree_Mask + mask_start + offs_m[:, None].to(tl.int64) * ext_len + offs_n[None, :],
                    mask=m_mask[:, None] & n_mask[None, :],
                    other=1,  # padding rows (past ext_len) stay causal: finite, never stored
                )
                visible = visible & (tree != 0)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Ext + kv_rows[:, None] * stride_vet + kv_head * stride_veh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = v.to(V_Buf.dtype.element_ty).to(q.dtype)
            m_i, l_i, acc = online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION)

        out = acc / l_i[:, None]
        o_ptr = Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention_fwd(
    q: torch.Tensor,  # [N, H, D]
    k_extend: torch.Tensor,  # [N, Hkv, D]
    v_extend: torch.Tensor,  # [N, Hkv, D]
    out: torch.Tensor,  # [N, H, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [bs + 1] int32
    kv_indptr: torch.Tensor,  # [bs + 1] int32, prefix slots only
    kv_indices: torch.Tensor,  # [total_prefix] int32
    max_extend_len: int,
    sm_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [sum e_b^2] uint8/bool, row-major per request
    mask_indptr: torch.Tensor | None = None,  # [bs + 1] int32 offsets into tree_mask
) -> torch.Tensor:
    """out = causal attention of the new tokens over (prefix ++ new tokens), per request; with a
    draft tree, each new token sees the prefix and only the new tokens its tree mask allows."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    bs = qo_indptr.shape[0] - 1
    if num_tokens == 0 or bs == 0:
        return out
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    q = last_dim_contiguous(q)
    k_extend = last_dim_contiguous(k_extend.view(num_tokens, num_kv_heads, head_dim))
    v_extend = last_dim_contiguous(v_extend.view(num_tokens, num_kv_heads, head_dim))
    use_tree = tree_mask is not None
    if use_tree:
        assert mask_indptr is not None and mask_indptr.shape[0] == bs + 1, "tree_mask needs mask_indptr"
        tree_mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        assert tree_mask.dtype == torch.uint8 and tree_mask.is_contiguous()
    interp = on_interpreter(q)
    block_d = max(next_pow2(head_dim), 16)
    if block_m is None:
        # 64x64 tiles keep a [64, 128] fp32 accumulator in registers at 4 warps; halve for D=256.
        block_m = 16 if interp else (64 if block_d <= 128 else 32)
    if block_n is None:
        block_n = 16 if interp else (64 if block_d <= 128 else 32)
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_extend,
        v_extend,
        out,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        tree_mask if use_tree else kv_indices,  # unread without the tree: any pointer will do
        mask_indptr if use_tree else kv_indptr,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv_group_num=num_heads // num_kv_heads,
        head_dim=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        USE_TREE_MASK=use_tree,
        num_warps=1 if interp else 4,
        num_stages=1 if interp else 2,
    )
    return out
