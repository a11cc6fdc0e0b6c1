"""The compiled CPU kernels (`sgl_kernel._cpu`), built by `make setup` against the installed torch.

The extension is optional: `available()` is False when it was not built (no compiler, or an
isolated pip build without torch), and callers then use their pure-torch reference paths.
Set RADIXSERVE_DISABLE_CPU_KERNELS=1 to force those paths (for A/B runs and tests).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

_ext: ModuleType | None
try:
    from sgl_kernel import _cpu as _ext
except ImportError:  # not built: the pure-torch paths are used
    _ext = None


def available() -> bool:
    return _ext is not None and os.environ.get("RADIXSERVE_DISABLE_CPU_KERNELS", "0") in ("", "0")


def _lib() -> ModuleType:
    if _ext is None:
        raise RuntimeError("sgl_kernel._cpu is not built; check sgl_kernel.cpu.available() first")
    return _ext


def decode_attention(
    q: torch.Tensor,  # [bs, num_heads, head_dim] fp32 (head_dim contiguous)
    k_buf: torch.Tensor,  # [pool_size, num_kv_heads, head_dim] fp32 or bf16
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64
    scale: float,
    out: torch.Tensor | None = None,  # [bs, num_heads, head_dim] fp32
) -> torch.Tensor:
    """Softmax(q·K^T·scale)·V over each request's slots req_to_token[row, :seq_len], reading the
    pool in place. Returns out [bs, num_heads, head_dim]."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    _lib().decode_attention(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, scale)
    return out


def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ weight.T (+ bias) with weight [N, K] stored in fp16; fp32 math.
    Returns [M, N] fp32. Fast for small M (reads the weight once, converting with F16C)."""
    return _lib().linear_f16(x, weight, bias)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), all fp32, for small M: streams the weight once with a
    register-tiled AVX2 kernel (torch's GEMM is 1.2-1.9x slower for M <= 32 on AVX2 CPUs)."""
    return _lib().linear_f32(x, weight, bias)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N] fp32 (rows contiguous) -> x * rsqrt(mean(x^2) + eps) * weight, a new [M, N]."""
    return _lib().rmsnorm(x, weight, eps)


def fused_add_rmsnorm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place on both [M, N] fp32 tensors: residual += x, then x = rmsnorm(residual) * weight."""
    _lib().fused_add_rmsnorm_(x, residual, weight, eps)


def rotary_neox_(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, num_heads, head_dim] fp32, head_dim contiguous (may be a qkv view)
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] fp32
    cos: torch.Tensor,  # [max_position, head_dim / 2] fp32
    sin: torch.Tensor,
) -> None:
    """Neox-style rotary embedding applied in place to q and k."""
    _lib().rotary_neox_(positions, q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2d] fp32 (gate then up) -> silu(gate) * up, [M, d]."""
    return _lib().silu_and_mul(x)


def store_kv(
    k_buf: torch.Tensor,  # [pool_size, num_kv_heads, head_dim] fp32
    v_buf: torch.Tensor,
    loc: torch.Tensor,  # [T] int64 slots
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] fp32, each token's heads contiguous
    v: torch.Tensor,
) -> None:
    """k_buf[loc] = k and v_buf[loc] = v in one call."""
    _lib().store_kv(k_buf, v_buf, loc, k, v)


def decode_model(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    scaling: float,
    cos: torch.Tensor,  # [max_position, head_dim / 2] fp32
    sin: torch.Tensor,
) -> object:
    """A `DecodeModel`: a Llama-family decoder stack whose decode step is one call. Fill it with
    `add_layer(input_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_norm, gate_up_w, gate_up_b,
    down_w, down_b, k_buf, v_buf)` per layer (weights fp32 or fp16, optional ones None) and
    `set_final_norm(w)`; then `forward(hidden, positions, out_cache_loc, req_to_token,
    req_pool_indices, seq_lens)` returns the final normed hidden states."""
    return _lib().DecodeModel(num_heads, num_kv_heads, head_dim, rms_norm_eps, scaling, cos, sin)
