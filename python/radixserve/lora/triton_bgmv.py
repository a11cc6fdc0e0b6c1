"""The LoRA delta as two Triton kernels (BGMV: each token row reads its own slot's matrices in
the kernel, nothing is gathered in memory). Imported only on CUDA; the tests run it in Triton's
CPU interpreter (TRITON_INTERPRET=1) against `lora_delta_reference`.

- shrink: one program per row: xa[row, :rank] = A[slot] @ x[row] (fp32 accumulation);
- expand: one program per (row, block of output columns): out[row, cols] += xa[row] @ B[slot][:, cols].

A base row (slot -1) reads slot 0 and adds its delta times zero: no branch, the same memory
pattern for every row.
"""

# Triton parses @triton.jit parameter annotations (tl.constexpr, dtype hints), so kernel
# arguments stay unannotated; every host-side function is fully typed.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink(
    x_ptr,
    a_ptr,
    slots_ptr,
    xa_ptr,
    K,
    R,
    stride_xm,
    stride_as,
    stride_ar,
    R_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    valid = (slot >= 0).to(tl.float32)
    slot = tl.maximum(slot, 0)
    offs_r = tl.arange(0, R_PAD)
    acc = tl.zeros([R_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs_k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a_ptrs = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :]
        a = tl.load(a_ptrs, mask=(offs_r[:, None] < R) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(xa_ptr + row * R_PAD + offs_r, acc * valid)


@triton.jit
def _expand(
    xa_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    N,
    R,
    stride_bs,
    stride_br,
    stride_om,
    R_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.maximum(tl.load(slots_ptr + row), 0)  # a base row's xa is all zeros
    offs_r = tl.arange(0, R_PAD)
    xa = tl.load(xa_ptr + row * R_PAD + offs_r)
    b_ptrs = b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :]
    b = tl.load(b_ptrs, mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
    delta = tl.sum(xa[:, None] * b, axis=0)  # [BLOCK]
    out_ptrs = out_ptr + row * stride_om + offs_n
    old = tl.load(out_ptrs, mask=offs_n < N, other=0.0)
    tl.store(out_ptrs, (old.to(tl.float32) + delta).to(old.dtype), mask=offs_n < N)


def lora_delta_triton(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """lora_delta_reference's contract: x [n, in], a [slots, rank, in], b [slots, rank, out],
    token_slots [n] int64; adds into out [n, out] (a column slice of a wider output is fine:
    rows may be strided, columns must be contiguous, as must x's and the pool's last dims)."""
    n, k = x.shape
    num_slots, rank, _ = a.shape
    n_out = b.shape[2]
    if n == 0:
        return
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    r_pad = triton.next_power_of_2(rank)
    xa = torch.empty(n, r_pad, dtype=torch.float32, device=x.device)  # [n, rank padded]
    _shrink[(n,)](
        x, a, token_slots, xa, k, rank, x.stride(0), a.stride(0), a.stride(1), R_PAD=r_pad, BLOCK=BLOCK_K
    )
    grid = (n, triton.cdiv(n_out, BLOCK_N))
    _expand[grid](
        xa,
        b,
        token_slots,
        out,
        n_out,
        rank,
        b.stride(0),
        b.stride(1),
        out.stride(0),
        R_PAD=r_pad,
        BLOCK=BLOCK_N,
    )
