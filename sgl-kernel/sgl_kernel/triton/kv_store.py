"""Paged-KV bookkeeping kernels: write a step's K/V into the pool, and flatten the request ->
slot table into CSR (kv_indptr / kv_indices) for the attention kernels."""

# Triton parses @triton.jit parameter annotations (tl.constexpr, dtype hints), so kernel
# arguments stay unannotated; every host-side function is fully typed.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.triton._common import last_dim_contiguous, next_pow2, on_interpreter


@triton.jit
def _kv_store_kernel(
    K,  # [N, Hkv, D] new keys (any float dtype)
    V,  # [N, Hkv, D]
    K_Buf,  # [S, Hkv, D] pool keys
    V_Buf,  # [S, Hkv, D]
    Loc,  # [N] int64 destination slots
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    num_kv_heads: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: a token's K and V rows are Hkv*D contiguous-ish elements, so the
    # whole row moves in one vectorised load/store pair.
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = K_Buf + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = V_Buf + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(k_dst, k.to(K_Buf.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_Buf.dtype.element_ty), mask=mask)


def store_kv_cache(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [N] int64
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
) -> None:
    """k_buffer[loc] = k; v_buffer[loc] = v (cast to the pool dtype). Same as
    MHATokenToKVPool.set_kv_buffer, in one launch for K and V."""
    n = loc.shape[0]
    if n == 0:
        return
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    k = last_dim_contiguous(k.view(n, num_kv_heads, head_dim))
    v = last_dim_contiguous(v.view(n, num_kv_heads, head_dim))
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    _kv_store_kernel[(n,)](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=1 if on_interpreter(k) else 4,
    )


@triton.jit
def _create_kv_indices_kernel(
    Req_To_Token,  # [R, max_context_len] int32
    Req_Pool_Indices,  # [bs] int64
    Lens,  # [bs] number of slots to copy per request
    Indptr,  # [bs + 1] int32 output offsets (exclusive cumsum of Lens)
    Out,  # [total] int32
    stride_row,
    BLOCK: tl.constexpr,
):
    # One program per request: copies req_to_token[row, :len] to Out[indptr[b]:indptr[b+1]].
    # Done on device so building metadata needs no host sync (and stays CUDA-graph capturable).
    b = tl.program_id(0)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    n = tl.load(Lens + b)
    dst = tl.load(Indptr + b).to(tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(Req_To_Token + row * stride_row + offs, mask=mask)
        tl.store(Out + dst + offs, slots, mask=mask)


def create_kv_indices(
    req_to_token: torch.Tensor,  # [R, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    lens: torch.Tensor,  # [bs] int
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR view of each request's first `lens[b]` slots: (kv_indptr [bs+1] int32,
    kv_indices [max(total, 1)] int32). `total` = sum(lens), known on the host from seq_lens_cpu."""
    bs = req_pool_indices.shape[0]
    device = req_to_token.device
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    if bs:
        indptr[1:] = torch.cumsum(lens, 0)
    # At least one element: some launchers reject zero-size buffers; the extra slot is never read.
    indices = torch.empty(max(total, 1), dtype=torch.int32, device=device)
    if bs and total:
        block = 16 if on_interpreter(req_to_token) else 512
        _create_kv_indices_kernel[(bs,)](
            req_to_token, req_pool_indices, lens, indptr, indices, req_to_token.stride(0), BLOCK=block
        )
    return indptr, indices
