"""Paged decode attention (one query token per request) as split-KV flash-decoding with GQA.

Why split-KV: decode has one query row per request, so a grid of (batch, kv_head) programs
leaves most SMs idle at small batch sizes while each program walks a long KV sequence. Stage 1
cuts every request's KV into up to `max_kv_splits` chunks and computes a partial softmax per
chunk in parallel (output normalised within the chunk plus its log-sum-exp); stage 2 merges the
chunks with their LSE weights. The number of chunks is per request (`num_kv_splits[b]`) so
short sequences are not split needlessly, while the grid stays a fixed shape (CUDA-graph safe).

GQA: one stage-1 program serves all query heads that share a KV head (rows of a [BLOCK_H, D]
query tile), so each K/V row is read from HBM once per group rather than once per query head.

Softmax runs in base 2 (exp2 with log2(e) folded into the scale): cheaper on GPUs, and the LSE
written by stage 1 is in the same base-2 units that stage 2 consumes.
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

LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    Q,  # [bs, H, D]
    K_Buf,  # [S, Hkv, D]
    V_Buf,  # [S, Hkv, D]
    Kv_Indptr,  # [bs + 1] int32
    Kv_Indices,  # [total] int32 pool slots
    Num_Kv_Splits,  # [bs] int32
    Mid_O,  # [bs, H, max_splits, D] fp32, normalised per split
    Mid_Lse,  # [bs, H, max_splits] fp32, base-2 log-sum-exp per split
    qk_scale,  # sm_scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    kv_group_num: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_H)  # query head within the group (padded to >= 16 for tl.dot)
    heads = kv_head * kv_group_num + offs_g
    h_mask = offs_g < kv_group_num
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    kv_start = tl.load(Kv_Indptr + b)
    kv_len = tl.load(Kv_Indptr + b + 1) - kv_start
    n_splits = tl.load(Num_Kv_Splits + b)
    # Stage 2 reads only splits < n_splits, so the grid's surplus programs have nothing to do.
    if split < n_splits:
        per_split = tl.cdiv(kv_len, n_splits)
        split_start = split * per_split
        split_end = tl.minimum(split_start + per_split, kv_len)  # may be empty: recorded as such

        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start in range(split_start, split_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < split_end
            # int64 before scaling: slot * row stride overflows int32 on large pools.
            slots = tl.load(Kv_Indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            qk = (
                tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
            )  # [BLOCK_H, BLOCK_N]
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            v = tl.load(
                V_Buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = v.to(q.dtype)
            m_i, l_i, acc = online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION)

        # Empty split: l_i == 0 -> LSE -inf, which stage 2 weights by zero.
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_ptr = Mid_O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(o_ptr, out, mask=h_mask[:, None] & d_mask[None, :])
        tl.store(Mid_Lse + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_stage2_kernel(
    Mid_O,  # [bs, H, max_splits, D] fp32
    Mid_Lse,  # [bs, H, max_splits] fp32
    Num_Kv_Splits,  # [bs] int32
    Out,  # [bs, H, D]
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    head_dim: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (request, query head): a weighted sum of the split outputs, weights
    # 2^(lse_s - max lse) / sum — the exact softmax over the whole sequence.
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(Num_Kv_Splits + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_splits
    lse = tl.load(Mid_Lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    valid = lse > float("-inf")
    m = tl.max(tl.where(valid, lse, -1e30), 0)
    w = tl.where(valid, tl.exp2(lse - m), 0.0)  # [BLOCK_S]
    o_ptr = Mid_O + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :]
    o = tl.load(o_ptr, mask=valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(
        Out + b * stride_outb + h * stride_outh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < head_dim
    )


def decode_attention_fwd(
    q: torch.Tensor,  # [bs, H, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    out: torch.Tensor,  # [bs, H, D]
    kv_indptr: torch.Tensor,  # [bs + 1] int32
    kv_indices: torch.Tensor,  # [total] int32
    num_kv_splits: torch.Tensor,  # [bs] int32, 1 <= value <= max_kv_splits
    max_kv_splits: int,  # grid size along the split axis
    sm_scale: float,
    block_n: int | None = None,
) -> torch.Tensor:
    """out[b, h] = softmax(q[b, h] . K_b^T * sm_scale) V_b over the slots
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] (GQA: query head h reads KV head h // (H / Hkv))."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if bs == 0:
        return out
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    q = last_dim_contiguous(q)
    interp = on_interpreter(q)
    group = num_heads // num_kv_heads
    block_d = max(next_pow2(head_dim), 16)
    block_h = max(next_pow2(group), 16)  # tl.dot needs M >= 16
    if block_n is None:
        block_n = 16 if interp else (64 if head_dim <= 128 else 32)
    mid_o = torch.empty(bs, num_heads, max_kv_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bs, num_heads, max_kv_splits, dtype=torch.float32, device=q.device)
    warps = 1 if interp else 4
    _decode_stage1_kernel[(bs, num_kv_heads, max_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        kv_group_num=group,
        head_dim=head_dim,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=1 if interp else 2,
    )
    _decode_stage2_kernel[(bs, num_heads)](
        mid_o,
        mid_lse,
        num_kv_splits,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim=head_dim,
        BLOCK_S=next_pow2(max_kv_splits),
        BLOCK_D=block_d,
        num_warps=1 if interp else 4,
    )
    return out


def choose_num_kv_splits(
    seq_lens: torch.Tensor,  # [bs] int
    num_kv_heads: int,
    max_kv_splits: int,
    num_sms: int,
    min_split_len: int,
) -> tuple[torch.Tensor, int]:
    """(per-request split counts [bs] int32 on device, grid split dimension) — no host sync.

    The cap aims for ~2 waves of (request, kv head, split) programs over the SMs; it depends only
    on the batch size, so it is known on the host and sizes the grid (a CUDA graph captured per
    batch size sees a fixed value). Each request then takes ceil(seq_len / min_split_len) splits
    up to that cap: chunks shorter than `min_split_len` cost more in the stage-2 merge than their
    parallelism buys.
    """
    bs = seq_lens.shape[0]
    cap = max(1, min(max_kv_splits, -(-2 * num_sms // max(bs * num_kv_heads, 1))))
    by_len = (seq_lens + min_split_len - 1) // min_split_len
    return by_len.clamp(1, cap).to(torch.int32), cap
