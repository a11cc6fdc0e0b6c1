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
    assert _ext is not None, "sgl_kernel._cpu is not built; check sgl_kernel.cpu.available() first"
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    _ext.decode_attention(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, scale)
    return out


def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ weight.T (+ bias) with weight [N, K] stored in fp16; fp32 math.
    Returns [M, N] fp32. Fast for small M (reads the weight once, converting with F16C)."""
    assert _ext is not None, "sgl_kernel._cpu is not built; check sgl_kernel.cpu.available() first"
    return _ext.linear_f16(x, weight, bias)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), all fp32, for small M: streams the weight once with a
    register-tiled AVX2 kernel (torch's GEMM is 1.2-1.9x slower for M <= 32 on AVX2 CPUs)."""
    assert _ext is not None, "sgl_kernel._cpu is not built; check sgl_kernel.cpu.available() first"
    return _ext.linear_f32(x, weight, bias)
