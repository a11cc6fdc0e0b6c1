"""Fused elementwise kernels for the decoder layer: RMSNorm (optionally fused with the residual
add), SiLU-and-mul, and neox-style rotary embedding.

Each is memory-bound; fusing saves HBM round trips (add + norm read x and residual once and
write both outputs in one pass; rope rotates q and k in one launch). Semantics mirror
radixserve.layers (norm.RMSNorm, activation.silu_and_mul, rotary.RotaryEmbedding) including
their rounding points, so the kernels are drop-in replacements.
"""

# Triton parses @triton.jit parameter annotations (tl.constexpr, dtype hints), so kernel
# arguments stay unannotated; every host-side function is fully typed.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.triton._common import next_pow2, on_interpreter


@triton.jit
def _rmsnorm_kernel(
    X,  # [M, N]
    Res,  # [M, N] residual in, overwritten with x + residual (unused when HAS_RES is False)
    W,  # [N]
    Out,  # [M, N]
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(Res + row * stride_r + offs, mask=mask, other=0.0)
        # The sum is rounded to the storage dtype first: it is the new residual stream, and the
        # reference normalises that rounded value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(Res.dtype.element_ty)
        tl.store(Res + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, 0) / n_cols
    normed = (x32 * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., N]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight; with `residual`: s = x + residual, returns (RMSNorm(s) * weight, s).
    The returned residual is a new tensor; the inputs are not modified."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    res = residual.reshape(-1, n).clone(memory_format=torch.contiguous_format) if residual is not None else x2
    if m:
        _rmsnorm_kernel[(m,)](
            x2,
            res,
            weight,
            out,
            x2.stride(0),
            res.stride(0),
            out.stride(0),
            n,
            eps,
            HAS_RES=residual is not None,
            BLOCK=next_pow2(n),
            num_warps=1 if on_interpreter(x) else (8 if n >= 4096 else 4),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res.view(shape)


@triton.jit
def _silu_and_mul_kernel(
    X,  # [M, 2 * N]: gate then up
    Out,  # [M, N]
    stride_x,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    # silu is rounded to the storage dtype before the product, as F.silu(gate) * up does.
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> silu(gate) * up, [..., d]."""
    d = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)
    block = min(next_pow2(d), 32 if on_interpreter(x) else 1024)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=1 if on_interpreter(x) else 4
        )
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _rope_kernel(
    X,  # [T, heads, D] q or k
    Out,  # [T, heads, D]
    Pos,  # [T] int64
    Cos,  # [max_pos, D/2] fp32
    Sin,  # [max_pos, D/2] fp32
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    num_heads,
    half: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: cos/sin for its position are loaded once and reused by all heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    cos = tl.load(Cos + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(Sin + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    base = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    # Neox layout: element i pairs with element i + D/2.
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    obase = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(obase, o1.to(Out.dtype.element_ty), mask=mask)
    tl.store(obase + half, o2.to(Out.dtype.element_ty), mask=mask)


def _rope_one(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t:
        _rope_kernel[(t,)](
            x,
            out,
            positions,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            heads,
            half=d // 2,
            BLOCK_H=next_pow2(heads),
            BLOCK_HALF=next_pow2(d // 2),
            num_warps=1 if on_interpreter(x) else 4,
        )
    return out


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [max_pos, D/2] fp32
    sin_cache: torch.Tensor,  # [max_pos, D/2] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rope on q and k (new tensors), computed in fp32 and rounded to the input dtype,
    matching layers.rotary.RotaryEmbedding.forward."""
    assert cos_cache.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    return _rope_one(q, positions, cos_cache, sin_cache), _rope_one(k, positions, cos_cache, sin_cache)
