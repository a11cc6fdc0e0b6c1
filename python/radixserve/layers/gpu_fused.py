"""The Triton fused elementwise kernels (sgl_kernel.triton.fused_ops) for tensors on a GPU.

Unfused, a bf16 decoder layer's RMSNorm, rotary embedding and SiLU-and-mul are ~35 small torch
kernels (the fp32 upcasts, the reductions, the halves of the rotation): at batch 1 on an H200 they
took ~1.5 ms of a Llama-3-8B decode step's 6.5 ms of kernel time (docs/benchmarks.md, GPU). The
fused kernels compute the same functions with the same rounding points (test/kernels/
test_fused_ops.py holds them to the torch references), one launch each.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch


@functools.cache
def _load() -> ModuleType | None:
    try:
        from sgl_kernel.triton import fused_ops
    except ImportError:  # no Triton: the torch paths run
        return None
    return fused_ops


def triton_ops(t: torch.Tensor) -> ModuleType | None:
    """The fused kernels' module where `t` is on a CUDA device and Triton is installed, else None."""
    return _load() if t.is_cuda else None
