"""Weight-only group-quantized GEMM for the GPU path: y [M, N] = x [M, K] @ dequant(W)^T (+ bias).

W is radixserve's GroupQuantWeight layout (layers/group_quant.py): integers q as int8 [N, K]
(8 bits) or uint8 [N, K // 2] (4 bits: input 2j in the low nibble of byte j, 2j + 1 in the high
one, values 0..15), fp32 scales [N, K // G] and optional fp32 offsets [N, K // G];
w = q * scale (+ offset) per group of G consecutive inputs.

Tiled over M and N (one program per [BLOCK_M, BLOCK_N] output tile) and K (a loop). BLOCK_K is
a power of two dividing the group size, so every K-tile lies inside one group: its scales (and
offsets) are one [BLOCK_N] vector loaded per tile, not per element. The tile's integers are
widened and scaled to fp32 in registers, then cast to the activation dtype for `tl.dot` (tensor
cores for bf16/fp16, IEEE fp32 for fp32 activations) with an fp32 accumulator; the bias is added
in fp32 and the output is written in the activation dtype. Under the interpreter a bf16 dot runs
in fp32 (the interpreter cannot multiply bf16), so the bf16 tensor-core path is the fp16 one's
code with another dtype, and only the fp16 instance of it is exercised here.

Written for CUDA and checked only under Triton's CPU interpreter (TRITON_INTERPRET=1) against
the dequantize-then-fp32-matmul reference; block sizes for the GPU are educated defaults, not
tuned on a device.
"""

# Triton parses @triton.jit parameter annotations (tl.constexpr, dtype hints), so kernel
# arguments stay unannotated; every host-side function is fully typed.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.triton._common import dot_precision, on_interpreter


@triton.jit
def _wq_gemm_kernel(
    X,  # [M, K] activations (fp32 / bf16 / fp16), unit stride along K
    QW,  # [N, K] int8 or [N, K // 2] uint8, unit stride along K
    Scales,  # [N, K // G] fp32
    Offsets,  # [N, K // G] fp32 (HAS_OFFSETS only)
    Bias,  # [N] (HAS_BIAS only)
    Out,  # [M, N] activation dtype
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_on,
    stride_om,
    group_size,
    BITS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = QW + offs_n[:, None].to(tl.int64) * stride_qn
    s_rows = Scales + offs_n.to(tl.int64) * stride_sn
    o_rows = Offsets + offs_n.to(tl.int64) * stride_on

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K is a multiple of the group size, which BLOCK_K divides: no mask along K.
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        if BITS == 8:
            q = tl.load(q_rows + kk[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
        else:
            # Each byte is read for both of its inputs (the second read hits the cache); the
            # low nibble holds the even input.
            packed = tl.load(q_rows + (kk // 2)[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
            q = ((packed >> ((kk % 2) * 4)[None, :]) & 0xF).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        group = k0 // group_size
        scale = tl.load(s_rows + group, mask=n_mask, other=0.0)  # [BLOCK_N]
        w = q * scale[:, None]
        if HAS_OFFSETS:
            w = w + tl.load(o_rows + group, mask=n_mask, other=0.0)[:, None]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptr = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_k(group_size: int, cap: int) -> int:
    """The largest power of two <= cap dividing group_size (a multiple of 16, so at least 16)."""
    block = 16
    while block * 2 <= cap and group_size % (block * 2) == 0:
        block *= 2
    return block


def wq_gemm(
    x: torch.Tensor,  # [..., K] fp32 / bf16 / fp16
    qweight: torch.Tensor,  # int8 [N, K] (bits 8) or uint8 [N, K // 2] (bits 4)
    scales: torch.Tensor,  # fp32 [N, K // group_size]
    offsets: torch.Tensor | None,  # fp32 [N, K // group_size]
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """x @ dequant(W)^T (+ bias): [..., N] in x's dtype, accumulated in fp32."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"wq_gemm takes fp32, bf16 or fp16 activations, got {x.dtype}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    if x.shape[-1] != k or k % group_size or group_size % 16:
        raise ValueError(
            f"x [..., {x.shape[-1]}] does not match a weight of {k} inputs in groups of {group_size}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    offsets = None if offsets is None else offsets.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if on_interpreter(x2):
        block_m, block_n, block_k, warps, stages = 16, 16, _block_k(group_size, 32), 1, 1
    else:
        # Decode-sized M reads each weight tile once for all rows; larger M takes taller tiles.
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k, warps, stages = 64, _block_k(group_size, 64), 4, 3
    # The interpreter's tl.dot has no bf16 (numpy has no such type; it returns garbage), so there a
    # bf16 tile is widened to fp32 for the dot. On a GPU bf16 runs on the tensor cores like fp16.
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and on_interpreter(x2))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wq_gemm_kernel[grid](
        x2,
        qweight,
        scales,
        offsets if offsets is not None else scales,  # unread without offsets
        bias.contiguous() if bias is not None else scales,  # unread without a bias
        out,
        m,
        n,
        k,
        x2.stride(0),
        qweight.stride(0),
        scales.stride(0),
        offsets.stride(0) if offsets is not None else 0,
        out.stride(0),
        group_size,
        BITS=bits,
        HAS_OFFSETS=offsets is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(torch.float32 if dot_fp32 else x.dtype),
        DOT_FP32=dot_fp32,
        num_warps=warps,
        num_stages=stages,
    )
    return out.reshape(*lead, n)
